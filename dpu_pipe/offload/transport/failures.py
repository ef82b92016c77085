"""Errors across the wire: a producer's exception packed, with its traceback, into the bytes of
a buffer (or a reply), and raised again on the host naming the producer and the step."""
import pickle

from ...errors import DecodeError, ProducerError, error_record


def pack_error(exc, tb_text, capacity, who):
    """Pickle the :func:`~dpu_pipe.errors.error_record` of ``exc`` (made by ``who``, with its
    traceback text ``tb_text``, default the one of ``exc``) and the exception itself into at
    most ``capacity`` bytes, dropping the exception object and trimming the traceback's head
    (its last frames say the most) and the message as needed. Returns b"" when not even a
    minimal record fits."""
    try:
        exc_blob = pickle.dumps(exc, protocol=4)
        pickle.loads(exc_blob)  # some exceptions pickle but do not unpickle
    except Exception:
        exc_blob = None
    record = error_record(exc, who)
    message = record["message"]
    if tb_text is None:
        tb_text = record["traceback"]

    def pack(exc_blob, tb, msg):
        return pickle.dumps(dict(record, message=msg, traceback=tb, exc=exc_blob), protocol=4)

    blob = pack(exc_blob, tb_text, message)
    if len(blob) <= capacity:
        return blob
    if exc_blob is not None and len(exc_blob) > capacity // 2:
        exc_blob = None
    msg = message[:max(0, capacity // 4)]
    spare = capacity - len(pack(exc_blob, "", msg))
    if spare > 40:
        tail = tb_text[-(spare - 40):]
        blob = pack(exc_blob, "...(truncated)\n" + tail, msg)
        while len(blob) > capacity and tail:  # non-ASCII text pickles longer than its length
            tail = tail[len(tail) // 8 + 1:]
            blob = pack(exc_blob, "...(truncated)\n" + tail, msg)
        if len(blob) <= capacity:
            return blob
    for blob in (pack(None, "", msg), pack(None, "", message[:40]), pack(None, "", "")):
        if len(blob) <= capacity:
            return blob
    return b""


def raise_remote(blob, who, epoch, step):
    """Raise on the host the error ``who`` published for step ``step`` of ``epoch``: a
    DecodeError as itself, with a note and a ProducerError cause naming ``who``; anything else
    as a ProducerError, caused by the original when that unpickles here."""
    where = f"step {step} of epoch {epoch}"
    if not blob:
        raise ProducerError(f"failed on {where} (the slot is too small to carry the error)",
                            producer=who)
    try:
        info = pickle.loads(blob)
    except Exception as exc:
        raise ProducerError(f"failed on {where}; its error record is unreadable: {exc!r}",
                            producer=who) from None
    exc_blob = info.get("exc")
    try:
        original = pickle.loads(exc_blob) if exc_blob is not None else None
    except Exception:  # its class may not exist on the host
        original = None
    remote = ProducerError(f"{info['type']}: {info['message']} (on {where})", producer=who,
                           remote_traceback=info.get("traceback") or None)
    if isinstance(original, DecodeError):
        if hasattr(original, "add_note"):
            original.add_note(f"raised in {who} on {where}")
        raise original from remote
    if isinstance(original, BaseException):
        raise remote from original
    raise remote
