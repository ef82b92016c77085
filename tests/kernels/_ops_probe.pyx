# What tests/test_ops.py needs to see inside the transform kernel and the package does not
# ship: the tables and pass order a plan holds, a forced pass order, the float16 conversions,
# the workspace bound. Built by tests/kernel_probes.py with the package's compiler flags; it
# calls the kernel in dpu_pipe._ops through that module's C API (_ops.pxd), so what it shows
# is the installed kernel's own plan and output. The float16 conversions are inline code of
# _ops.pxd, compiled here from the same source with the same flags.
from libc.stdint cimport uint8_t, uint16_t

from dpu_pipe._ops cimport (OpsAxis, OpsOutput, OpsPlan, OpsWorkspace, OPS_OK, OPS_FLOAT32,
                            OPS_UINT8, OPS_H_FIRST, OPS_V_FIRST, ops_ws_init, ops_ws_free,
                            ops_workspace_bytes, ops_output_init, ops_plan, ops_run,
                            ops_f16c_convert, ops_have_f16c, _to_f16)

ORDER_CODES = {"h_first": OPS_H_FIRST, "v_first": OPS_V_FIRST}


cdef _table(const OpsAxis* ax):
    """(starts, counts, weights) of the first n_out entries of an axis, in output order."""
    cdef int i, t
    return ([ax.start[i] for i in range(ax.n_out)], [ax.count[i] for i in range(ax.n_out)],
            [[ax.weight[i * ax.ksize + t] for t in range(ax.count[i])]
             for i in range(ax.n_out)])


def plan(int src_h, int src_w, double y0, double x0, double h, double w, int oh, int ow,
         bint flip=False, int filt=0):
    """ops_plan for box (y0, x0, h, w) of a src_h x src_w image resampled to (oh, ow):
    (order, columns, rows), order an ORDER_CODES value and each axis (starts, counts,
    weights) per output, columns mirrored when flip. ValueError with ops_plan's code when it
    refuses."""
    cdef OpsWorkspace ws
    cdef OpsPlan p
    cdef int rc
    ops_ws_init(&ws)
    try:
        rc = ops_plan(&p, &ws, src_h, src_w, y0, x0, h, w, oh, ow, flip, filt)
        if rc != OPS_OK:
            raise ValueError(f"ops_plan returned {rc}")
        return p.order, _table(&p.h), _table(&p.v)
    finally:
        ops_ws_free(&ws)


def resize_crop_order(const uint8_t[:, :, :] img, double y0, double x0, double h, double w,
                      uint8_t[::1] out, int oh, int ow, bint flip, int dtype, int layout,
                      mean, std, int order):
    """ops_plan + ops_run as dpu_pipe._ops.resize_crop_into does, with the plan's pass order
    replaced by order (an ORDER_CODES value). out: the bytes of one sample."""
    cdef double m[3]
    cdef double s[3]
    cdef OpsOutput o
    cdef OpsWorkspace ws
    cdef OpsPlan p
    cdef int rc, c
    cdef Py_ssize_t esize = 4 if dtype == OPS_FLOAT32 else (1 if dtype == OPS_UINT8 else 2)
    if img.shape[0] < 1 or img.shape[1] < 1 or img.shape[2] != 3 or img.strides[1] != 3 \
            or img.strides[2] != 1:
        raise ValueError("image must be non-empty (H, W, 3) uint8 with 3-byte pixels")
    if out.shape[0] != esize * 3 * <Py_ssize_t>oh * ow:
        raise ValueError(f"output buffer holds {out.shape[0]} bytes, needs {esize * 3 * oh * ow}")
    if order != OPS_H_FIRST and order != OPS_V_FIRST:
        raise ValueError(f"pass order {order}")
    for c in range(3):
        m[c] = mean[c]
        s[c] = std[c]
    rc = ops_output_init(&o, dtype, layout, m, s)
    if rc != OPS_OK:
        raise ValueError(f"ops_output_init returned {rc}")
    ops_ws_init(&ws)
    try:
        with nogil:
            rc = ops_plan(&p, &ws, <int>img.shape[0], <int>img.shape[1], y0, x0, h, w, oh, ow,
                          flip, 0)
            if rc == OPS_OK:
                p.order = order
                rc = ops_run(&p, &img[0, 0, 0], img.strides[0], &o, &out[0])
        if rc != OPS_OK:
            raise ValueError(f"ops_plan/ops_run returned {rc}")
    finally:
        ops_ws_free(&ws)


def workspace_bytes(int src_w, double h, double w, int oh, int ow, int filt=0):
    """ops_workspace_bytes: bytes of workspace one plan needs; 0 for invalid sizes."""
    return ops_workspace_bytes(src_w, h, w, oh, ow, filt)


def has_f16c():
    """Whether ops_run converts float16 output with x86's F16C instructions on this CPU."""
    return bool(ops_have_f16c())


def float32_to_float16_bits(const float[::1] src, uint16_t[::1] dst, bint f16c=False):
    """dst[i] = binary16 bits of src[i] by the kernel's portable conversion (_to_f16), or by
    its F16C one (ops_f16c_convert) if f16c."""
    cdef Py_ssize_t i
    if dst.shape[0] != src.shape[0]:
        raise ValueError("src and dst lengths differ")
    if f16c and not ops_have_f16c():
        raise ValueError("this CPU has no F16C instructions")
    if src.shape[0] == 0:
        return
    with nogil:
        if f16c:
            ops_f16c_convert(&src[0], &dst[0], src.shape[0])
        else:
            for i in range(src.shape[0]):
                dst[i] = _to_f16(src[i])
