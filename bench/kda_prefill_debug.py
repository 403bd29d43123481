"""GPU triage of the chunked KDA prefill kernels (pallas_kernels/kda_prefill.py, issue 9).

    python -m bench.kda_prefill_debug --out-dir DIR --repro --budget-s 420   # H200
    python -m bench.kda_prefill_debug --out-dir DIR --extra --long --sanitize
    python -m bench.kda_prefill_debug --interpret --configs T100 --out-dir DIR  # CPU smoke

Runs each configuration of kda_prefill.GPU_CHECKS (the gpu_only tests of
tests/test_pallas_kda_prefill.py, with the tests' inputs via its gpu_check_call) one kernel stage
at a time, each in its own subprocess with a timeout: an illegal instruction poisons the
process's CUDA context, so every later call of that process fails too. Stages:
  prep      kernel 1 alone (kda_prefill._prefill(prep_only=True)): outputs finite; G_C vs the
            float64 in-chunk sum of g on 4 heads (relative RMSE <= 1e-3)
  pipeline  both kernels, the test's call: o and the final state finite; relative RMSE vs the
            XLA reference lingjax.ops.kda.kda_chunked (all heads) and vs the float64 oracle on
            4 heads (the test's bar, 5e-3; skipped above --oracle-max-T)
  state     kernel 2 alone on synthetic chunk-space inputs vs a float64 reference on 4 heads
With --stages auto (default) a config runs prep, then pipeline if prep passed, and state where
either failed (which kernel faults?). A row records status (ok, inaccurate, error, crash,
timeout, skipped), the phase reached (inputs, compile, run, warm, check: where a crash or a
timeout struck), the CUDA error, compile / first-call / warm times and, on the GPU, ptxas'
registers and spills per kernel (MOSAIC_GPU_DUMP_PTXAS; --no-ptxas to skip).
--repro also runs kernel 1 with the pre-fix token-space beta on T8192_packed3 (a sequence starts
at token 1001) and T8192_packed3_aligned (starts at 1004): a fault on the first only confirms the
cause found for issue 9 (record["repro"] says so). --sanitize re-runs every failed stage under
compute-sanitizer memcheck (faulting kernel, block, thread, SASS offset); --sass / --ptx keep
jax's dumps (MOSAIC_GPU_DUMP_SASS / _PTX) of every run in DIR/kda_prefill_debug_dumps.tar.gz.
--extra adds EXTRA_CHECKS (16-byte-aligned packed starts, fused + packed, initial state with
block_v=64 at the SMEM limit), --long T=65536. --budget-s: start no run past this many seconds,
so the command ends with its files written. --interpret: Mosaic GPU interpret mode on CPU, every
config shrunk (T <= 150, H = --heads, default 1).

Files in DIR: kda_prefill_debug-<time>.json (bench.common.save_result: one row per run),
kda_prefill_debug.log (per run: command, ptxas lines, error, stderr tail, sanitizer report), the
dump archive with --sass / --ptx; kda_prefill_debug-partial.json is rewritten after every run and
removed at the end (left behind only if the whole command is killed).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from pallas_kernels.kda_prefill import GPU_CHECKS, GpuCheck

ROOT = Path(__file__).resolve().parents[1]
NAME = "kda_prefill_debug"
STAGES = ("prep", "state", "pipeline")
ACCURACY = 5e-3          # the tests' bar (relative RMSE vs float64)
TIGHT = 1e-3             # G_C and the state-only stage (no bf16 rounding of the math in between)

# Diagnostics beyond the tests (--extra, --long).
EXTRA_CHECKS = (
    # Same packing as T8192_packed3 but every sequence starts at a multiple of 4 tokens: if only
    # the unaligned one fails, the fault is an alignment one (issue 9: beta's TMA box).
    GpuCheck("T8192_packed3_aligned", 8192, cu=(0, 1000, 1004, 8192)),
    GpuCheck("T8192_fused_packed3", 8192, cu=(0, 1000, 1001, 8192), fused=True, seed=1),
    # Initial state, block_v = 64: kernel 2's SMEM is at the 227 KiB limit.
    GpuCheck("T8192_state_bv64", 8192, cu=(0, 3000, 8192), with_state=True, block_v=64),
)
LONG_CHECKS = (GpuCheck("T65536", 65536),)
ALL_CHECKS = {c.name: c for c in GPU_CHECKS + EXTRA_CHECKS + LONG_CHECKS}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.kda_prefill_debug", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=None, help="result directory (default bench/results)")
    ap.add_argument("--configs", default="", help="comma list of config names (default: "
                    f"GPU_CHECKS = {','.join(c.name for c in GPU_CHECKS)})")
    ap.add_argument("--extra", action="store_true", help="add EXTRA_CHECKS")
    ap.add_argument("--long", action="store_true", help="add T=65536")
    ap.add_argument("--stages", default="auto",
                    help="auto, or a comma list of prep,state,pipeline (all run)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per run")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no run after this many seconds (0: no limit)")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the XLA and float64 references (faster; finiteness only)")
    ap.add_argument("--oracle-max-T", type=int, default=16384,
                    help="skip the float64 oracle (a Python token loop) above this T")
    ap.add_argument("--no-ptxas", action="store_true", help="do not ask for ptxas' -v output")
    ap.add_argument("--sass", action="store_true", help="archive the SASS of every run")
    ap.add_argument("--ptx", action="store_true", help="archive the PTX of every run")
    ap.add_argument("--sanitize", action="store_true",
                    help="re-run failed stages under compute-sanitizer (memcheck)")
    ap.add_argument("--repro", action="store_true",
                    help="also run kernel 1 with the pre-fix token-space beta on T8192_packed3 "
                    "(expected on the GPU: illegal instruction) and T8192_packed3_aligned "
                    "(expected: ok)")
    ap.add_argument("--interpret", action="store_true",
                    help="Mosaic GPU interpret mode at small shapes (CPU smoke)")
    ap.add_argument("--heads", type=int, default=None,
                    help="H for every config (default: the config's, 1 under --interpret)")
    # internal: one stage of one config in this process
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage", default=None, choices=STAGES, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--token-space-beta", action="store_true", help=argparse.SUPPRESS)
    return ap


# ----------------------------------------------------------------------------- configs


def shrink(case: GpuCheck, heads: int) -> GpuCheck:
    """Interpret-mode version of a config: T <= 150 (packed: the same number of sequences, empty
    and one-token ones kept), H = heads."""
    T = min(case.T, 150 if case.cu else 130)
    cu = None
    if case.cu is not None:
        cu = [0]
        for lo, hi in zip(case.cu[:-1], case.cu[1:]):
            step = 0 if hi == lo else max(1, round(hi * T / case.T) - cu[-1])
            cu.append(cu[-1] + step)
        cu, T = tuple(cu), cu[-1]
    return case._replace(T=T, cu=cu, H=heads)


def selected_checks(a) -> list[GpuCheck]:
    names = [x.strip() for x in a.configs.split(",") if x.strip()]
    if not names:
        names = [c.name for c in GPU_CHECKS]
        names += [c.name for c in EXTRA_CHECKS] if a.extra else []
        names += [c.name for c in LONG_CHECKS] if a.long else []
    unknown = [n for n in names if n not in ALL_CHECKS]
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; known: {sorted(ALL_CHECKS)}")
    return [ALL_CHECKS[n] for n in names]


def effective(case: GpuCheck, a) -> GpuCheck:
    if a.interpret:
        return shrink(case, a.heads or 1)
    return case._replace(H=a.heads) if a.heads else case


# ----------------------------------------------------------------------------- worker


def _flush_c_stdio():
    """Mosaic writes its dumps through C++ stdout: flush it now (a later crash would lose it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except Exception:   # noqa: BLE001 -- best effort
        pass


def _rel_rmse(x, ref):
    import numpy as np
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _check_heads(H):
    return sorted({0, 7, 19, 31} & set(range(H))) or [0]


def _state_inputs(case, cu, interpret):
    """Kernel 2 alone: synthetic bf16 chunk-space W, U, Kd, Qg, Aqk (zero rows past each chunk's
    tokens, as kernel 1 writes them), decays G_C in [-1, -0.05]; small W, Kd keep the state
    recurrence contracting. Returns (fn, args)."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import kda_prefill as kp
    T, H, K, V, C = case.T, case.H, case.K, case.V, kp.CHUNK
    cu_j = jnp.asarray(cu, jnp.int32)
    tok0, ntok, clo, chi = kp.chunk_tables(cu_j, T, len(cu) - 1)
    N = tok0.shape[0]
    rng = np.random.default_rng(case.seed if case.seed is not None else T)
    valid = np.arange(C)[None, :] < np.asarray(ntok)[:, None]                 # [N, C]
    rows = valid[:, None, :, None]

    def rand(shape, sd, mask):
        return jnp.asarray(sd * rng.standard_normal(shape, dtype=np.float32) * mask, jnp.bfloat16)
    w = rand((N, H, C, K), 0.02, rows)
    u = rand((N, H, C, V), 1.0, rows)
    kd = rand((N, H, C, K), 0.02, rows)
    qg = rand((N, H, C, K), 0.05, rows)
    aqk = rand((N, H, C, C), 0.05, rows * valid[:, None, None, :] * np.tril(np.ones((C, C))))
    gc = jnp.asarray(-rng.uniform(0.05, 1.0, (N, H, K)), jnp.float32)
    s0 = None
    if case.with_state:
        s0 = jnp.asarray(0.5 * rng.standard_normal((len(cu) - 1, H, K, V)), jnp.float32)

    def fn(clo, chi, cu_j, w, u, kd, qg, aqk, gc, s0):
        return kp._state(clo, chi, cu_j, w, u, kd, qg, aqk, gc, s0, T, case.block_v, jnp.float32,
                         interpret)
    return fn, (clo, chi, cu_j, w, u, kd, qg, aqk, gc, s0)


def _state_reference(case, cu, args, heads):
    """float64 kernel-2 math on a few heads: V' = U - W S; O = Qg S + Aqk V';
    S <- exp(G_C) S + Kd^T V'."""
    import numpy as np
    C = 64
    clo, chi, _, w, u, kd, qg, aqk, gc, s0 = args
    f64 = lambda x: np.asarray(x.astype("float32"), np.float64)[:, heads]
    W, U, KD, QG, A, G = (f64(x) for x in (w, u, kd, qg, aqk, gc))
    clo, chi = np.asarray(clo), np.asarray(chi)
    o = np.zeros((case.T, len(heads), case.V))
    states = []
    for s in range(len(cu) - 1):
        St = (np.zeros((len(heads), case.K, case.V)) if s0 is None
              else np.asarray(s0, np.float64)[s, heads])
        for c in range(clo[s], chi[s]):
            vp = U[c] - W[c] @ St
            oc = QG[c] @ St + A[c] @ vp
            St = np.exp(G[c])[..., None] * St + np.swapaxes(KD[c], -1, -2) @ vp
            r0 = cu[s] + (c - clo[s]) * C
            n = min(C, cu[s + 1] - r0)
            if n > 0:
                o[r0:r0 + n] = oc[:, :n].transpose(1, 0, 2)
        states.append(St)
    return o, np.stack(states)


def _prep_checks(out, pre, heads):
    """Kernel 1's outputs finite; G_C vs the float64 sum of g over each chunk's valid rows."""
    import numpy as np
    (w, u, kd, qg, aqk, gc), (tok0, ntok, _, _, _) = out
    res = {"finite": all(bool(np.isfinite(np.asarray(x, np.float32)).all())
                         for x in (w, u, kd, qg, aqk, gc))}
    if pre is not None:
        g = np.asarray(pre[3], np.float64)[:, heads]                           # [T, h, K]
        ref = np.stack([g[t:t + n].sum(0) for t, n in zip(np.asarray(tok0), np.asarray(ntok))])
        got = np.asarray(gc, np.float64)[:, heads]
        res["gc_rel_rmse"] = _rel_rmse(got, ref)
        res["gc_max_abs_err"] = float(np.abs(got - ref).max())
    ok = res["finite"] and res.get("gc_rel_rmse", 0.0) <= TIGHT
    return ok, res


def _pipeline_checks(out, pre, cu, case, a, tk, heads):
    import jax.numpy as jnp
    import numpy as np
    o, s = out
    res = {"finite": bool(jnp.isfinite(o).all()) and bool(jnp.isfinite(s).all())}
    if pre is not None and not a.no_reference:
        ro, rs = tk._reference(*pre[:5], pre[5], cu, "xla")
        res["rmse_o_xla"], res["rmse_s_xla"] = _rel_rmse(o, ro), _rel_rmse(s, rs)
        if case.T <= a.oracle_max_T:
            ro, rs = tk._oracle_heads(*pre[:5], heads, cu, pre[5])
            res["rmse_o_f64"] = _rel_rmse(np.asarray(o)[:, heads], ro)
            res["rmse_s_f64"] = _rel_rmse(np.asarray(s)[:, heads], rs)
    errs = [v for k, v in res.items() if k.startswith("rmse_") and k.endswith("_f64")]
    errs = errs or [v for k, v in res.items() if k.startswith("rmse_")]
    return res["finite"] and all(e <= ACCURACY for e in errs), res


def worker(a) -> None:
    """One stage of one config; writes its row to a.result after every phase, then _exit."""
    path = Path(a.result)
    row = {"config": a.worker, "stage": a.stage, "phase": "import", "status": "running"}

    def save(**kw):
        row.update(kw)
        path.write_text(json.dumps(row))
    save()
    code = 0
    try:
        import jax
        jax.config.update("jax_default_matmul_precision", "highest")   # as tests/conftest.py
        from jax.experimental.pallas import mosaic_gpu as plgpu
        sys.path.insert(0, str(ROOT))
        import tests.test_pallas_kda_prefill as tk         # the tests' inputs; enables x64
        if a.token_space_beta:
            from pallas_kernels import kda_prefill as kp
            kp._TOKEN_SPACE_BETA = True
            save(token_space_beta=True)

        case = effective(ALL_CHECKS[a.worker], a)
        interpret = plgpu.InterpretGPUParams() if a.interpret else False
        save(phase="inputs", case=case._asdict(), backend=jax.default_backend(),
             device=getattr(jax.devices()[0], "device_kind", str(jax.devices()[0])))
        heads = _check_heads(case.H)
        cu = [0, case.T] if case.cu is None else list(case.cu)
        if a.stage == "state":
            fn, args = _state_inputs(case, cu, interpret)
            pre = None
        else:
            fn0, args, pre, cu = tk.gpu_check_call(case, interpret)
            fn = (lambda *xs: fn0(*xs, prep_only=True)) if a.stage == "prep" else fn0
        if a.no_reference:
            pre = None
        save(phase="compile")
        t = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        _flush_c_stdio()
        save(phase="run", compile_s=time.perf_counter() - t)
        t = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))        # Mosaic may finish compiling here
        _flush_c_stdio()
        save(phase="warm", first_call_s=time.perf_counter() - t)
        t = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        save(phase="check", warm_ms=(time.perf_counter() - t) * 1e3)
        if a.stage == "prep":
            ok, res = _prep_checks(out, pre, heads)
        elif a.stage == "pipeline":
            ok, res = _pipeline_checks(out, pre, cu, case, a, tk, heads)
        else:
            import numpy as np
            o, s = out
            res = {"finite": all(bool(np.isfinite(np.asarray(x)).all()) for x in (o, s))}
            if not a.no_reference:
                ro, rs = _state_reference(case, cu, args, heads)
                res["rmse_o_f64"] = _rel_rmse(np.asarray(o)[:, heads], ro)
                res["rmse_s_f64"] = _rel_rmse(np.asarray(s)[:, heads], rs)
            ok = res["finite"] and all(v <= TIGHT for k, v in res.items() if k.startswith("rmse"))
        save(phase="done", status="ok" if ok else "inaccurate", **res)
    except BaseException as e:   # noqa: BLE001 -- the row records every failure, even SystemExit
        import traceback
        save(status="error", error=f"{type(e).__name__}: {str(e)[:3000]}",
             traceback=traceback.format_exc()[-3000:])
        code = 1
    _flush_c_stdio()
    os._exit(code)      # no teardown: a poisoned CUDA context can hang or abort at exit


# ----------------------------------------------------------------------------- driver

_PTXAS_FN = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PTXAS_SPILL = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_CUDA_ERR = re.compile(r"(CUDA_ERROR_\w+|illegal instruction|misaligned address"
                       r"|illegal memory access|unspecified launch failure|out of memory)", re.I)


def parse_ptxas(text: str) -> tuple[list[dict], list[str]]:
    """ptxas -v output -> one dict per entry function (registers, spills, stack), and the lines."""
    kernels, lines, cur = [], [], None
    for line in text.splitlines():
        if "ptxas" not in line and not _PTXAS_SPILL.search(line):
            continue
        if line.strip() not in lines:
            lines.append(line.strip())
        if m := _PTXAS_FN.search(line):
            cur = {"function": m[1], "arch": m[2]}
            kernels.append(cur)
        elif cur is not None and (m := _PTXAS_SPILL.search(line)):
            cur.update(stack_bytes=int(m[1]), spill_store_bytes=int(m[2]),
                       spill_load_bytes=int(m[3]))
        elif cur is not None and (m := _PTXAS_REGS.search(line)):
            cur["registers"] = int(m[1])
            if s := _PTXAS_SMEM.search(line):
                cur["smem_bytes"] = int(s[1])
    return kernels, lines[:60]


def _tail(path: Path, n_lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n_lines:])
    except OSError:
        return ""


def _run_proc(cmd, env, timeout, out_path, err_path):
    """Run cmd in its own process group; kill that group (by id) at the timeout."""
    with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, cwd=ROOT, env=env, start_new_session=True)
        try:
            return p.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            return p.returncode, True


class Driver:
    def __init__(self, a, tmp: Path, log):
        self.a, self.tmp, self.log = a, tmp, log
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.dumps: list[Path] = []
        self.n = 0

    def over_budget(self) -> bool:
        return bool(self.a.budget_s) and time.monotonic() - self.t0 > self.a.budget_s

    def worker_cmd(self, case, stage, result, no_reference=False, token_beta=False):
        a = self.a
        cmd = [sys.executable, "-m", "bench.kda_prefill_debug", "--worker", case.name,
               "--stage", stage, "--result", str(result), "--oracle-max-T", str(a.oracle_max_T)]
        cmd += ["--interpret"] if a.interpret else []
        cmd += ["--heads", str(a.heads)] if a.heads else []
        cmd += ["--no-reference"] if (a.no_reference or no_reference) else []
        cmd += ["--token-space-beta"] if token_beta else []
        return cmd

    def env(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not self.a.interpret:
            if not self.a.no_ptxas:
                env["MOSAIC_GPU_DUMP_PTXAS"] = "1"
            if self.a.sass:
                env["MOSAIC_GPU_DUMP_SASS"] = "1"
            if self.a.ptx:
                env["MOSAIC_GPU_DUMP_PTX"] = "1"
        return env

    def run(self, case, stage, sanitize=False, token_beta=False) -> dict:
        a = self.a
        self.n += 1
        tag = (f"{self.n:02d}-{case.name}-{stage}" + ("-sanitizer" if sanitize else "")
               + ("-token_space_beta" if token_beta else ""))
        result, out_p, err_p = (self.tmp / f"{tag}.{x}" for x in ("json", "out", "err"))
        cmd = self.worker_cmd(case, stage, result, no_reference=sanitize, token_beta=token_beta)
        env = self.env()
        if sanitize:
            tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
            if not Path(tool).exists():
                return {"config": case.name, "stage": stage,
                        "sanitizer": ["compute-sanitizer not found"]}
            cmd = [tool, "--tool", "memcheck", "--print-limit", "20"] + cmd
            env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false")
            for k in ("MOSAIC_GPU_DUMP_SASS", "MOSAIC_GPU_DUMP_PTX"):
                env.pop(k, None)
        t = time.perf_counter()
        rc, timed_out = _run_proc(cmd, env, a.timeout_s, out_p, err_p)
        wall = time.perf_counter() - t
        try:
            row = json.loads(result.read_text())
        except (OSError, json.JSONDecodeError):
            row = {"config": case.name, "stage": stage, "phase": "start", "status": "running"}
        row["wall_s"] = round(wall, 2)
        row["returncode"] = rc
        if token_beta:
            row["token_space_beta"] = True
        if timed_out:
            row["status"] = "timeout"
            row["error"] = f"killed after {a.timeout_s:.0f} s in phase {row.get('phase')}"
        elif row.get("status") == "running":
            row["status"] = "crash"
            row["error"] = f"exit code {rc} in phase {row.get('phase')}"
        stdout = out_p.read_text(errors="replace") if out_p.exists() else ""
        stderr_tail = _tail(err_p, 60)
        if row.get("status") != "ok":
            m = _CUDA_ERR.findall(stderr_tail + "\n" + row.get("error", ""))
            if m:
                row["cuda_error"] = m[-1]
        row["ptxas"], ptxas_lines = parse_ptxas(stdout + "\n" + _tail(err_p, 400))
        report = []
        if sanitize:
            err_all = err_p.read_text(errors="replace") if err_p.exists() else ""
            report = [ln for ln in (stdout + "\n" + err_all).splitlines()
                      if ln.startswith("=========")][:80]
            row = {"config": case.name, "stage": stage, "sanitizer": report,
                   **{k: row[k] for k in ("status", "phase", "error", "cuda_error", "wall_s",
                                          "token_space_beta") if k in row}}
        if (a.sass or a.ptx) and not sanitize and stdout:
            self.dumps.append(out_p)
        self.log.write(f"=== {tag}: {row.get('status')} ({wall:.1f} s)\n$ {' '.join(cmd)}\n")
        for ln in ptxas_lines:
            self.log.write(f"  {ln}\n")
        if row.get("error"):
            self.log.write(f"error: {row['error']}\n")
        if row.get("traceback"):
            self.log.write(row.pop("traceback") + "\n")
        self.log.write("--- stderr tail\n" + stderr_tail + "\n")
        for ln in report:
            self.log.write(ln + "\n")
        self.log.write("\n")
        self.log.flush()
        line = {k: row.get(k) for k in ("config", "stage", "status", "phase", "wall_s",
                                         "compile_s", "warm_ms", "rmse_o_f64", "rmse_o_xla",
                                         "gc_rel_rmse", "cuda_error") if row.get(k) is not None}
        if row.get("ptxas"):
            line["regs_spills"] = [(k.get("registers"), k.get("spill_store_bytes"))
                                   for k in row["ptxas"]]
        print(json.dumps(line), flush=True)
        return row

    def add(self, row):
        self.rows.append(row)
        out = Path(self.a.out_dir) if self.a.out_dir else None
        if out is not None:
            (out / f"{NAME}-partial.json").write_text(json.dumps({"rows": self.rows}, indent=1))

    def skip(self, case, stage, why):
        self.add({"config": case.name, "stage": stage, "status": "skipped", "error": why})


def _ok(row) -> bool:
    return row.get("status") == "ok"


def repro_verdict(rows) -> str:
    """What --repro's two runs of kernel 1 with the pre-fix token-space beta say."""
    rep = {r["config"]: r for r in rows if r.get("token_space_beta")}
    al, un = rep.get("T8192_packed3_aligned"), rep.get("T8192_packed3")
    if al is None or un is None:
        return "incomplete"
    fault = lambda r: r.get("status") in ("error", "crash") and "illegal instruction" in (
        (r.get("cuda_error") or "") + (r.get("error") or "")).lower()
    if _ok(al) and fault(un):
        return ("confirmed: the pre-fix beta layout faults (illegal instruction) only when a "
                "sequence starts at a token not a multiple of 4")
    if _ok(al) and _ok(un):
        return "not reproduced: the pre-fix beta layout runs with unaligned starts too"
    return f"inconclusive: aligned {al.get('status')}, unaligned {un.get('status')}"


def main(argv=None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)                     # does not return
    try:
        cases = selected_checks(a)
    except ValueError as e:
        ap.error(str(e))
    stages = (STAGES if a.stages == "auto"
              else tuple(s.strip() for s in a.stages.split(",") if s.strip()))
    if not stages or any(s not in STAGES for s in stages):
        ap.error(f"--stages must be auto or a comma list of {','.join(STAGES)}")
    if a.heads is not None and a.heads < 1 or a.timeout_s <= 0:
        ap.error("--heads and --timeout-s must be positive")
    out_dir = Path(a.out_dir) if a.out_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    log_path = (out_dir or Path(tempfile.gettempdir())) / f"{NAME}.log"
    with tempfile.TemporaryDirectory(prefix="kda_debug_") as tmp, open(log_path, "w") as log:
        d = Driver(a, Path(tmp), log)
        for case in cases:
            by_stage = {}
            for stage in stages:
                if a.stages == "auto":
                    prep = by_stage.get("prep")
                    if stage == "pipeline" and prep is not None and not _ok(prep):
                        d.skip(case, stage, "prep failed")
                        continue
                    if stage == "state" and (prep is not None and _ok(prep)):
                        continue              # decided after the pipeline, below
                if d.over_budget():
                    d.skip(case, stage, f"over --budget-s {a.budget_s:.0f}")
                    continue
                by_stage[stage] = d.run(effective(case, a), stage)
                d.add(by_stage[stage])
            pipe = by_stage.get("pipeline")
            if (a.stages == "auto" and pipe is not None and not _ok(pipe)
                    and "state" not in by_stage):
                if d.over_budget():
                    d.skip(case, "state", f"over --budget-s {a.budget_s:.0f}")
                else:
                    d.add(d.run(effective(case, a), "state"))
        if a.repro:
            for name in ("T8192_packed3_aligned", "T8192_packed3"):
                if d.over_budget():
                    d.skip(ALL_CHECKS[name], "prep", "repro over --budget-s")
                    continue
                d.add(d.run(effective(ALL_CHECKS[name], a), "prep", token_beta=True))
        sanitized = []
        if a.sanitize and not a.interpret:
            failed = [r for r in d.rows if r.get("status") in ("error", "crash", "timeout")]
            for r in failed:
                if d.over_budget():
                    break
                sanitized.append(d.run(effective(ALL_CHECKS[r["config"]], a), r["stage"],
                                       sanitize=True, token_beta=bool(r.get("token_space_beta"))))
        if d.dumps and out_dir is not None:
            with tarfile.open(out_dir / f"{NAME}_dumps.tar.gz", "w:gz") as tar:
                for p in d.dumps:
                    tar.add(p, arcname=p.name)
        rows = d.rows
    from bench.common import save_result
    record = {"bench": NAME, "interpret": a.interpret, "stages": a.stages,
              "timeout_s": a.timeout_s, "budget_s": a.budget_s, "log": str(log_path),
              "summary": [f"{r['config']}/{r['stage']}"
                          + (" (token-space beta)" if r.get("token_space_beta") else "")
                          + f": {r.get('status')}" for r in rows],
              "rows": rows, "sanitizer": sanitized}
    if a.repro:
        record["repro"] = repro_verdict(rows)
    path = save_result(NAME, record, out_dir)
    if out_dir is not None:
        (out_dir / f"{NAME}-partial.json").unlink(missing_ok=True)
    record["result_path"] = str(path)
    return record


if __name__ == "__main__":
    main()
