"""Step of ``scripts/gpu_check.sh``: what one epoch of ``examples/train_imagenet.py
--device cuda --amp`` (offloaded to 2 producer ranks) left behind::

    python scripts/gpu/train_check.py --run-dir D --log LOG --exit-status N --result R.json \\
        [--epochs 1 --producers 2 --val-count 80]

Checked: the run exited 0; its ``--json`` records (``D/log.json``) hold every epoch with a
finite loss, world size 1 and the producers, and a validation of every sample
(:func:`common.check_train_records`); NCCL ran the collectives (its ``NCCL_DEBUG=VERSION``
line is in the log); the final weights (``D/final_weights.pt``) are finite.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Checks, check_train_records, write_result  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="the run's --checkpoint folder")
    ap.add_argument("--log", required=True, help="the run's stdout and stderr")
    ap.add_argument("--exit-status", type=int, required=True, help="the run's exit status")
    ap.add_argument("--result", required=True, help="JSON record of this step")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--val-count", type=int, required=True)
    args = ap.parse_args(argv)

    with open(args.log, errors="replace") as f:
        log = f.read()
    records = []
    path = os.path.join(args.run_dir, "log.json")
    if os.path.exists(path):
        with open(path) as f:
            records = json.load(f)
    checks = check_train_records(records, epochs=args.epochs, producers=args.producers,
                                 val_count=args.val_count)
    first = Checks()
    first.add("the run exited 0", args.exit_status == 0,
              f"exit {args.exit_status}" + ("" if args.exit_status == 0
                                            else "; log tail: " + log[-1500:]))
    nccl = [line.strip() for line in log.splitlines() if "NCCL version" in line]
    first.add("NCCL ran the collectives", bool(nccl), nccl[0] if nccl else
              "no 'NCCL version' line (NCCL_DEBUG=VERSION) in the log")
    weights = os.path.join(args.run_dir, "final_weights.pt")
    if os.path.exists(weights):
        import torch

        state = torch.load(weights, map_location="cpu")
        bad = [k for k, v in state.items() if v.is_floating_point() and
               not bool(torch.isfinite(v).all())]
        first.add("final weights finite", not bad, ", ".join(bad[:5]))
    else:
        first.add("final weights finite", False, f"no {weights}")
    first.items.extend(checks.items)
    r = records[-1] if records else {}
    summary = (f"{len(records)} epoch(s): train_loss {r.get('train_loss')}, val_top1 "
               f"{r.get('val_top1')}, {r.get('img_per_s', 0):.0f} img/s, data wait "
               f"{r.get('data_wait_share', 0):.1%}")
    bad = first.failed()
    if bad:
        summary = f"{len(bad)} check(s) failed: {bad[0]['name']}; " + summary
    write_result(args.result, "train", first, summary, records=records, order=4)
    for c in first.items:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail'][:300]}", flush=True)
    print(f"train: {summary}", flush=True)
    return 0 if first.ok else 1


if __name__ == "__main__":
    sys.exit(main())
