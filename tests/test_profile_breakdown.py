"""bench/profile_breakdown.py: HLO -> component mapping, the trace parser on a synthetic trace in the
GPU (CUPTI stream) format with exact sums, and a real CPU profile of a jitted loop with named scopes."""
import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from bench import profile_breakdown as pb

# ---- HLO mapping -------------------------------------------------------------------------------
HLO = """HloModule jit__run, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_kda (p0: f32[4], p1: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %mul.1 = f32[4]{0} multiply(%p0, %p1), metadata={op_name="jit(_run)/while/body/kda/mul" stack_frame_id=1}
  ROOT %add.1 = f32[4]{0} add(%mul.1, %p1), metadata={op_name="jit(_run)/while/body/add"}
}

%fused_moe (p0.1: f32[4,4], p1.1: f32[4]) -> f32[4] {
  %p0.1 = f32[4,4]{1,0} parameter(0)
  %p1.1 = f32[4]{0} parameter(1)
  %dot.1 = f32[4]{0} dot(%p1.1, %p0.1), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(_run)/while/body/moe/dot_general"}
  %add.2 = f32[4]{0} add(%dot.1, %p1.1), metadata={op_name="jit(_run)/while/body/commit/add"}
  ROOT %mul.2 = f32[4]{0} multiply(%add.2, %p1.1), metadata={op_name="jit(_run)/while/body/commit/mul"}
}

%fused_norm (p0.3: f32[4], p1.3: s32[]) -> f32[4] {
  %p0.3 = f32[4]{0} parameter(0)
  %p1.3 = s32[] parameter(1)
  %lt.3 = pred[] compare(%p1.3, %p1.3), direction=LT, metadata={op_name="jit(_run)/while/body/embed/lt"}
  %sel.3 = s32[] select(%lt.3, %p1.3, %p1.3), metadata={op_name="jit(_run)/while/body/embed/select_n"}
  %cv.3 = f32[] convert(%sel.3), metadata={op_name="jit(_run)/while/body/embed/convert"}
  %b.3 = f32[4]{0} broadcast(%cv.3), dimensions={}, metadata={op_name="jit(_run)/while/body/embed/broadcast"}
  ROOT %m.3 = f32[4]{0} multiply(%p0.3, %b.3), metadata={op_name="jit(_run)/while/body/kda/mul"}
}

fused_acc (p0.2: f32[4]) -> f32[4] {
  p0.2 = f32[4]{0} parameter(0)
  ROOT eq.1 = f32[4]{0} negate(p0.2), metadata={op_name="jit(_run)/while/body/accept/eq"}
}

%command_buffer (p.9: f32[4]) -> f32[4] {
  %p.9 = f32[4]{0} parameter(0)
  ROOT %neg.9 = f32[4]{0} negate(%p.9), metadata={op_name="jit(_run)/while/body/moe/neg"}
}

%body (arg: (s32[], f32[4], f32[4,4])) -> (s32[], f32[4], f32[4,4]) {
  %arg = (s32[], f32[4]{0}, f32[4,4]{1,0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%arg), index=1
  %w = f32[4,4]{1,0} get-tuple-element(%arg), index=2
  %i = s32[] get-tuple-element(%arg), index=0
  %loop_multiply_fusion.3 = f32[4]{0} fusion(%x, %x), kind=kLoop, calls=%fused_kda, metadata={op_name="jit(_run)/while/body/add"}
  %input_reduce_fusion.1 = f32[4]{0} fusion(%w, %loop_multiply_fusion.3), kind=kInput, calls=%fused_moe, metadata={op_name="jit(_run)/while/body/commit/mul"}
  %multiply_fusion.5 = f32[4]{0} fusion(%x, %i), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(_run)/while/body/kda/mul"}
  %custom-call.7 = f32[4]{0} custom-call(%input_reduce_fusion.1, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(_run)/while/body/draft/while/body/moe/dot_general"}
  %dot.9 = f32[4]{0} dot(%loop_multiply_fusion.3, %w), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={stack_frame_id=3}
  %argmax.2 = f32[4]{0} negate(%custom-call.7), metadata={op_name="jit(_run)/while/body/argmax"}
  fusion.4 = f32[4]{0} fusion(argmax.2), kind=kLoop, calls=fused_acc
  %call.2 = f32[4]{0} call(%dot.9), to_apply=%command_buffer
  %mla.7 = f32[4]{0} negate(%call.2), metadata={op_name="jit(_run)/while/body/mla/kda/moe/neg"}
  %dot.10 = f32[4]{0} dot(%loop_multiply_fusion.3, %input_reduce_fusion.1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %bc.1 = f32[4]{0} bitcast(%custom-call.7)
  %dot.11 = f32[4]{0} dot(%bc.1, %w), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %tuple.1 = (s32[], f32[4]{0}, f32[4,4]{1,0}) tuple(%i, %mla.7, %w)
}

%cond (arg.1: (s32[], f32[4], f32[4,4])) -> pred[] {
  %arg.1 = (s32[], f32[4]{0}, f32[4,4]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %c.1 = s32[] constant(3)
  ROOT %lt.1 = pred[] compare(%i.1, %c.1), direction=LT, metadata={op_name="jit(_run)/while/cond/lt"}
}

ENTRY %main.1 (p.0: (s32[], f32[4], f32[4,4])) -> (s32[], f32[4], f32[4,4]) {
  %p.0 = (s32[], f32[4]{0}, f32[4,4]{1,0}) parameter(0)
  ROOT %while.1 = (s32[], f32[4]{0}, f32[4,4]{1,0}) while(%p.0), condition=%cond, body=%body, metadata={op_name="jit(_run)/while"}
}
"""


@pytest.mark.parametrize("path,comp", [
    ("jit(f)/while/body/kda/mul", "kda"),
    ("jit(f)/draft/while/body/mla/moe/dot_general", "draft"),    # draft wins over nested scopes
    ("jit(f)/moe/kda/dot_general", "kda"),                       # otherwise the innermost
    ("jit(f)/moe_router/x", None), ("jit(f)/drafty/x", None), ("jit(commit)/x", None), ("", None), (None, None),
])
def test_component_of(path, comp):
    assert pb.component_of(path) == comp


def test_hlo_components():
    m = pb.hlo_components(HLO)
    assert m["loop_multiply_fusion.3"] == "kda"           # fusion: fused ops vote, not its root's metadata
    assert m["input_reduce_fusion.1"] == "moe"            # the dot outvotes two commit elementwise ops
    assert m["multiply_fusion.5"] == "kda"                # no heavy op: its root's, not the majority's
    assert m["custom-call.7"] == "draft"
    assert m["fusion.4"] == "accept"                      # text printed without '%'
    assert m["dot.9"] == "kda"                            # no op_name: its scoped neighbours agree
    assert m["dot.11"] == "draft"                         # ... reached through a bitcast
    assert m["dot.10"] is None                            # ... disagree (kda and moe operands)
    assert m["argmax.2"] is None and m["lt.1"] is None    # outside every scope
    assert m["mla.7"] == "moe"
    assert "while.1" not in m and "call.2" not in m       # containers are never an answer
    idx = pb.HloIndex([HLO])
    assert idx.op("custom-call.7", "jit__run") == (True, "draft")
    assert idx.op("custom-call.7", "jit_unknown") == (True, "draft")   # unknown module: agreed entry
    assert idx.op("while.1") == (False, None) and idx.is_container("while.1")
    assert idx.kernel("input_reduce_fusion_1") == (True, "moe")        # XLA:GPU kernel name of a fusion
    with pytest.raises(pb.ProfileBreakdownError):
        pb.hlo_components("not hlo")


def test_hlo_index_modules_disagree():
    other = HLO.replace("jit__run", "jit__prefill").replace("while/body/draft/while/body/moe", "while/body/moe")
    idx = pb.HloIndex([HLO, other])
    assert idx.op("custom-call.7", "jit__prefill") == (True, "moe")
    assert idx.op("custom-call.7", "jit__run") == (True, "draft")
    assert idx.op("custom-call.7") == (False, None)                    # ambiguous without the module


# ---- synthetic trace in the GPU format ---------------------------------------------------------
def _trace(kernels, extra=()):
    """Chrome trace JSON: host python thread with a 'decode' span [100, 200], a host XLA thread
    (ignored when a device exists), GPU streams 13 and 14, CUPTI overhead and a derived XLA Ops line."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 10, "name": "thread_name", "args": {"name": "python"}},
            {"ph": "M", "pid": 1, "tid": 11, "name": "thread_name", "args": {"name": "tf_XLAExecute/1"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 20, "name": "thread_name", "args": {"name": "Stream #13(Kernel,MemcpyD2H)"}},
            {"ph": "M", "pid": 2, "tid": 21, "name": "thread_name", "args": {"name": "Stream #14(Kernel)"}},
            {"ph": "M", "pid": 2, "tid": 22, "name": "thread_name", "args": {"name": "CUPTI overhead"}},
            {"ph": "M", "pid": 2, "tid": 23, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    host = [{"ph": "X", "pid": 1, "tid": 10, "ts": 100, "dur": 100, "name": "decode"},
            {"ph": "X", "pid": 1, "tid": 11, "ts": 100, "dur": 50, "name": "loop_multiply_fusion.3",
             "args": {"hlo_op": "loop_multiply_fusion.3", "hlo_module": "jit__run"}},
            {"ph": "X", "pid": 2, "tid": 22, "ts": 100, "dur": 50, "name": "overhead"},
            {"ph": "X", "pid": 2, "tid": 23, "ts": 100, "dur": 100, "name": "loop_multiply_fusion.3",
             "args": {"hlo_op": "loop_multiply_fusion.3"}}]
    dev = [{"ph": "X", "pid": 2, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}
           for tid, ts, dur, name, args in kernels]
    return {"displayTimeUnit": "ns", "traceEvents": meta + host + dev + list(extra)}


RUN = {"hlo_module": "jit__run"}
KERNELS = [
    (20, 50, 10, "loop_multiply_fusion_3", {"hlo_op": "loop_multiply_fusion.3", **RUN}),     # before window
    (20, 100, 10, "loop_multiply_fusion_3", {"hlo_op": "loop_multiply_fusion.3", **RUN}),    # kda 10
    (20, 110, 20, "sm90_xmma_gemm_f32f32", {"hlo_op": "custom-call.7", **RUN}),              # draft 20
    (21, 120, 15, "fusion_4", {"hlo_op": "fusion.4", **RUN}),                                # accept 15 (stream 14)
    (20, 130, 10, "input_reduce_fusion_1", {"hlo_op": "call.2", "cuda_graph_id": 5, **RUN}), # moe by kernel name
    (20, 140, 5, "MemcpyD2H", {}),                                                           # other
    (20, 150, 10, "mla_kernel", {"name": "while/body/mla/dot_general", "correlation_id": 7}),  # mla by op path
    (20, 160, 4, "argmax_kernel", {"hlo_op": "argmax.2", **RUN}),                            # other (unscoped)
    (20, 170, 6, "dot_9", {"hlo_op": "dot.9", **RUN}),                                       # kda 6
    (20, 180, 3, "mystery", {"hlo_op": "fusion.99", "hlo_module": "jit_other"}),             # other (not in HLO)
    (20, 195, 10, "loop_multiply_fusion_3", {"hlo_op": "loop_multiply_fusion.3", **RUN}),    # kda 5 of 10 in window
    (20, 250, 10, "input_reduce_fusion_1", {"hlo_op": "input_reduce_fusion.1", **RUN}),      # after window
]


def _write(tmp_path, trace):
    run = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump(trace, f)
    return tmp_path


def test_synthetic_gpu_trace_window(tmp_path):
    d = _write(tmp_path, _trace(KERNELS))
    b = pb.breakdown(d, [HLO], steps=2, window_event="decode")
    expect = {"kda": 21, "mla": 10, "moe": 10, "dense_mlp": 0, "embed": 0, "lm_head": 0, "draft": 20,
              "accept": 15, "commit": 0, "other": 12}
    # busy: union of [100,145] [150,164] [170,176] [180,183] [195,200] (stream 14 lies inside) = 73
    expect["idle"] = 100 - 73
    assert b.total_us == pytest.approx(expect)
    assert b.window_us == 100 and b.busy_us == pytest.approx(73)
    assert b.per_step_us == pytest.approx({k: v / 2 for k, v in expect.items()})
    assert b.share == pytest.approx({k: v / 100 for k, v in expect.items()})
    assert b.kernels == {"kda": 3, "mla": 1, "moe": 1, "dense_mlp": 0, "embed": 0, "lm_head": 0, "draft": 1,
                         "accept": 1, "commit": 0, "other": 3, "idle": 0}
    assert b.kernels_per_step["kda"] == 1.5
    assert b.matched_by == {"hlo_op": 5, "inferred": 1, "name": 1, "kernel": 1, "none": 2}
    assert [(o["name"], o["hlo_op"], o["us"], o["count"], o["reason"]) for o in b.unmatched] == [
        ("MemcpyD2H", "", 5, 1, "no hlo_op"), ("argmax_kernel", "argmax.2", 4, 1, "unscoped"),
        ("mystery", "fusion.99", 3, 1, "not in HLO")]
    assert b.devices == ["/device:GPU:0"] and any("CUDA graphs" in n for n in b.notes)
    # kernels by name within a component, numeric suffixes dropped: kda = 10 + 5 (in window) + 6
    assert b.top_kernels["kda"] == [{"name": "loop_multiply_fusion", "us": 15, "count": 2},
                                    {"name": "dot", "us": 6, "count": 1}]
    assert pb.kernel_kind("loop_pad_fusion_84") == "loop_pad_fusion" and pb.kernel_kind("x.1_2") == "x"
    assert "kernels by name per component" in pb.format_table(b)
    same = pb.breakdown(d, [HLO], steps=2, windows=[(100, 150), (150, 200)])
    assert same.total_us == pytest.approx(b.total_us) and same.kernels == b.kernels


def test_synthetic_gpu_trace_whole(tmp_path):
    d = _write(tmp_path, _trace(KERNELS))
    b = pb.breakdown(d, [HLO], steps=None, top=1)
    assert b.window_us == 210                                     # first kernel start 50 .. last end 260
    assert b.total_us["kda"] == 10 + 10 + 6 + 10 and b.total_us["moe"] == 20
    assert b.busy_us == pytest.approx(73 + 5 + 10 + 10) and b.total_us["idle"] == pytest.approx(210 - 98)
    assert b.per_step_us is None and b.kernels_per_step is None and len(b.unmatched) == 1
    table = pb.format_table(b)
    assert all(r in table for r in pb.ROWS) and "MemcpyD2H" in table


def test_synthetic_two_devices_mean(tmp_path):
    gpu1 = [{"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:GPU:1"}},
            {"ph": "M", "pid": 3, "tid": 30, "name": "thread_name", "args": {"name": "Stream #7(Kernel)"}},
            {"ph": "X", "pid": 3, "tid": 30, "ts": 100, "dur": 40, "name": "loop_multiply_fusion_3",
             "args": {"hlo_op": "loop_multiply_fusion.3", **RUN}}]
    d = _write(tmp_path, _trace(KERNELS[1:2], gpu1))            # GPU 0: kda [100,110]; GPU 1: kda [100,140]
    b = pb.breakdown(d, [HLO], steps=1, window_event="decode")
    assert b.devices == ["/device:GPU:0", "/device:GPU:1"]
    assert b.total_us["kda"] == 25 and b.total_us["idle"] == 75 and b.kernels["kda"] == 2
    assert b.kernels_per_step["kda"] == 1


def test_host_ops_nesting_and_containers(tmp_path):
    """CPU-backend format: XLA op events on host threads; a while thunk spans its body's ops and a
    nested op leaves its parent only its own time."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 11, "name": "thread_name", "args": {"name": "tf_XLAExecute/1"}}]

    def op(ts, dur, name):
        return {"ph": "X", "pid": 1, "tid": 11, "ts": ts, "dur": dur, "name": name,
                "args": {"hlo_op": name, "hlo_module": "jit__run", "device_ordinal": "0"}}
    ev = [op(0, 100, "while.1"), op(10, 30, "custom-call.7"), op(15, 5, "dot.9"), op(50, 20, "fusion.4")]
    b = pb.breakdown(_write(tmp_path, {"traceEvents": meta + ev}), [HLO])
    # the while thunk is not an op: window = first to last op [10, 70], busy [10, 40] + [50, 70]
    assert b.window_us == 60 and b.total_us["draft"] == 25 and b.total_us["kda"] == 5
    assert b.total_us["accept"] == 20 and b.total_us["other"] == 0 and b.total_us["idle"] == 10
    assert b.devices == ["/host:CPU device 0"] and any("CPU backend" in n for n in b.notes)


def test_errors(tmp_path):
    d = _write(tmp_path, _trace(KERNELS))
    with pytest.raises(pb.ProfileBreakdownError, match="HLO"):
        pb.breakdown(d, [])
    with pytest.raises(pb.ProfileBreakdownError, match="nope"):
        pb.breakdown(d, [HLO], window_event="nope")
    with pytest.raises(pb.ProfileBreakdownError, match="steps"):
        pb.breakdown(d, [HLO], steps=0)
    with pytest.raises(pb.ProfileBreakdownError, match="no trace"):
        pb.breakdown(tmp_path / "missing", [HLO])


def test_cli(tmp_path, capsys):
    d = _write(tmp_path, _trace(KERNELS))
    hlo = pb.dump_hlo(HLO, tmp_path / "hlo" / "run.hlo.txt")
    pb.main([str(d), "--hlo", str(hlo), "--steps", "2", "--window-event", "decode"])
    out = capsys.readouterr().out.strip().splitlines()
    rec = json.loads(out[-1])
    assert rec["total_us"]["draft"] == 20 and rec["per_step_us"]["kda"] == 10.5
    assert out[0].split()[:3] == ["component", "total", "ms"]
    with pytest.raises(SystemExit) as e:
        pb.main([str(tmp_path / "missing"), "--hlo", str(hlo)])
    assert e.value.code == 2


# ---- real CPU profile ----------------------------------------------------------------------------
LOOP = 3


def _step(x, w):
    """One 'decode step' with ops in kda, moe and draft (the draft's only work is inside a nested
    'moe' scope: it is counted as draft only if 'draft' wins over it). Sorts keep ops unfused."""
    with jax.named_scope("draft"):
        with jax.named_scope("moe"):
            x = jnp.sort(jnp.exp(x @ w * 0.01), axis=-1)
    with jax.named_scope("kda"):
        x = jnp.sort(jnp.tanh(x @ w), axis=-1)
    with jax.named_scope("moe"):
        x = jnp.sort(x @ w, axis=0)
    return x


def _loop(x, w):
    return jax.lax.fori_loop(0, LOOP, lambda i, x: _step(x, w), x)


def test_cpu_profile(tmp_path):
    f = jax.jit(_loop)
    x = jnp.ones((128, 128), jnp.float32)
    w = jnp.full((128, 128), 1e-3, jnp.float32)
    hlo = pb.dump_hlo(f.lower(x, w).compile(), tmp_path / "loop.hlo.txt")
    jax.block_until_ready(f(x, w))
    runs = 3
    with jax.profiler.trace(str(tmp_path / "trace")):
        jax.block_until_ready(f(x, w))                              # outside the annotated window
        with jax.profiler.TraceAnnotation("timed"):
            for _ in range(runs):
                jax.block_until_ready(f(x, w))
    texts = [hlo.read_text()]
    whole = pb.breakdown(tmp_path / "trace", texts, steps=(runs + 1) * LOOP)
    timed = pb.breakdown(tmp_path / "trace", texts, steps=runs * LOOP, window_event="timed")
    for b in (whole, timed):
        for c in ("kda", "moe", "draft"):
            assert b.total_us[c] > 0 and b.kernels[c] > 0, (c, b.total_us)
        for c in ("mla", "dense_mlp", "embed", "lm_head", "accept", "commit"):
            assert b.total_us[c] == 0 and b.kernels[c] == 0
        busy_sum = sum(b.total_us[r] for r in pb.ROWS if r != pb.IDLE)
        assert busy_sum >= b.busy_us * (1 - 1e-9) and b.total_us[pb.IDLE] >= 0
        assert b.matched_by["none"] == 0 and b.trace.endswith(".trace.json.gz")
    for c in ("kda", "moe", "draft"):                               # the same ops every step
        assert whole.kernels[c] * runs == timed.kernels[c] * (runs + 1)
        assert whole.kernels_per_step[c] == timed.kernels_per_step[c]
        assert timed.kernels_per_step[c] >= 1
    assert timed.window_us < whole.window_us
    xplane = next((tmp_path / "trace").rglob("*.xplane.pb"))      # the xplane reader agrees on the ops
    xb = pb.breakdown(xplane, texts, steps=(runs + 1) * LOOP)
    assert xb.kernels == whole.kernels


COLL_HLO = """HloModule jit__coll

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs_body (q: f32[8]) -> f32[4] {
  %q = f32[8]{0} parameter(0)
  ROOT %rs.1 = f32[4]{0} reduce-scatter(%q), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p: f32[8]) -> f32[4] {
  %p = f32[8]{0} parameter(0)
  %ar.1 = f32[8]{0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(f)/moe/psum"}
  %ard.1 = f32[8]{0} all-reduce-done(%ar.1), metadata={op_name="jit(f)/moe/psum"}
  %neg.1 = f32[8]{0} negate(%ard.1), metadata={op_name="jit(f)/kda/neg"}
  %as.1 = ((f32[8]), f32[4]) async-start(%neg.1), calls=%rs_body
  ROOT %ad.1 = f32[4]{0} async-done(%as.1)
}
"""


def test_collectives(tmp_path):
    """Collective kernels are summed apart (by instruction: all-reduce-start, an async wrapper of a
    reduce-scatter; by name: NCCL's kernels) and still count in their component's row."""
    mod = {"hlo_module": "jit__coll"}
    kernels = [(20, 100, 8, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", {"hlo_op": "ar.1", **mod}),
               (20, 110, 10, "neg_1", {"hlo_op": "neg.1", **mod}),
               (20, 120, 4, "some_kernel", {"hlo_op": "as.1", **mod}),
               (20, 130, 2, "ncclDevKernel_SendRecv", {}),
               (20, 140, 3, "small_reduce_fusion", {}),                          # not 'all_reduce'
               (20, 150, 1, "all_reduce_lookalike", {"hlo_op": "neg.1", **mod})]  # the HLO decides
    b = pb.breakdown(_write(tmp_path, _trace(kernels)), [COLL_HLO], steps=2, window_event="decode")
    assert b.collective_us == pytest.approx(8 + 4 + 2) and b.collective_kernels == 3
    assert b.collective_per_step_us == pytest.approx(7)
    assert b.total_us["moe"] == 8 and b.total_us["kda"] == 10 + 1
    assert "collectives (inside the rows above): 0.014 ms" in pb.format_table(b)
    assert b.as_dict()["collective_per_step_us"] == pytest.approx(7)
    none = pb.breakdown(_write(tmp_path / "b", _trace(kernels[1:2])), [COLL_HLO], steps=1, window_event="decode")
    assert none.collective_us == 0 and "collectives" not in pb.format_table(none)
