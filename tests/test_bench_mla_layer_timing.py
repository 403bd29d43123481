"""bench/mla_layer_timing.py: a CPU smoke run (record fields), the kernel table of a carried-state loop, the
Decoder's cache size, bad flags."""
import pytest

from bench import mla_layer_timing


def test_smoke_record(tmp_path):
    rec = mla_layer_timing.main(["--tiny", "--M", "1,3", "--iters", "1", "--layers", "1", "--dense-kernel", "xla",
                                 "--mla-kernel", "xla,pallas", "--context", "64", "--out", str(tmp_path)])
    assert rec["bench"] == "mla_layer_timing" and rec["smoke"] and rec["preset"] == "ling3-tiny"
    assert rec["dtype"] == "fp8" and rec["context"] == 64 and rec["cache_len"] == mla_layer_timing.decoder_cache_len(64)
    assert rec["weight_bytes"] > 0 and rec["cache_alloc_bytes"] > 0
    assert rec["mla_kernels"] == ["xla", "pallas"] and rec["mla_warpgroups"] == [None]
    assert [(r["mla_kernel"], r["M"]) for r in rec["rows"]] == [("xla", 1), ("pallas", 1), ("xla", 3), ("pallas", 3)]
    assert [r["warpgroups"] for r in rec["rows"]] == [None, 1, None, 1]


def test_warpgroups_flag(tmp_path, monkeypatch):
    """--mla-warpgroups: the Pallas rows run the form asked for (the ling3-tiny preset has Ling's
    MLA widths, so both forms fit) and the module default comes back afterwards. Only form 1 runs
    here: in interpret mode, inside this benchmark's loop on a 2-CPU host, the two-warpgroup kernel
    waited forever on a barrier (session 18; docs/PERFORMANCE.md: a loop of layer calls hangs, one
    call or a loop of bare kernel calls finishes, bit-identical to form 1;
    tests/test_pallas_mla_decode.py runs it so)."""
    from pallas_kernels import mla_decode
    monkeypatch.setattr(mla_decode, "WARPGROUPS", 2)
    rec = mla_layer_timing.main(["--tiny", "--M", "1", "--iters", "1", "--layers", "1", "--dense-kernel", "xla",
                                 "--mla-kernel", "pallas", "--mla-warpgroups", "1", "--context", "64",
                                 "--out", str(tmp_path)])
    assert rec["mla_warpgroups"] == [1] and [r["warpgroups"] for r in rec["rows"]] == [1]
    assert mla_decode.WARPGROUPS == 2
    assert mla_layer_timing.build_parser().parse_args(["--mla-warpgroups", "1,2"]).mla_warpgroups == "1,2"


def test_profile_loop_with_a_carried_state(tmp_path):
    """bench.kernel_table.profile_loop on a toy layer with a cache (what --profile runs, without
    compiling an MLA layer once more): a table with the layer's dot."""
    import jax.numpy as jnp
    from jax import lax

    from bench.kernel_table import profile_loop

    def f(x, w, cache):
        return x @ w, lax.dynamic_update_slice_in_dim(cache, x, 3, axis=0)
    sets = [(jnp.ones((2, 64), jnp.float32), jnp.ones((64, 64), jnp.float32), jnp.zeros((16, 64), jnp.float32))]
    rows = profile_loop(f, sets, 2, tmp_path / "prof", per_iter=1, carry_last=True)
    assert rows and any("dot" in r["what"] for r in rows) and all(r["us_per_call"] >= 0 for r in rows)


def test_decoder_cache_len():
    """The Decoder's cache for bench.batch1 (8192-token prompt in 2048-token chunks, 1024 output, 8
    drafts, 2 more), in whole multiples of lingjax.spec_decode.CACHE_ALIGN."""
    from lingjax.spec_decode import CACHE_ALIGN
    assert mla_layer_timing.CACHE_ALIGN == CACHE_ALIGN == 64
    assert mla_layer_timing.decoder_cache_len(8192) == 9280             # 8192 + 1024 + 8 + 2 = 9226
    assert mla_layer_timing.decoder_cache_len(3000) == 5184             # prompt padded to whole chunks: 5130
    assert mla_layer_timing.decoder_cache_len(64) == 1152               # 1098


@pytest.mark.parametrize("argv, msg", [
    (["--M", "0"], "--M needs"), (["--M", "17"], "--M needs"), (["--M", "1,x"], "--M must be"),
    (["--iters", "0"], "--M needs"), (["--layers", "0"], "--M needs"), (["--context", "0"], "--context must"),
    (["--context", "2000", "--cache-len", "1000"], "does not fit"),
    (["--context", "1000", "--cache-len", "1008", "--M", "9"], "does not fit"),
    (["--copy-bw", "0"], "--copy-bw"),
    (["--mla-kernel", "triton"], "--mla-kernel must be"), (["--mla-kernel", ""], "--mla-kernel at least"),
    (["--mla-kernel", "pallas", "--context", "100", "--cache-len", "1001"], "multiple of 8"),
    (["--mla-warpgroups", "3"], "--mla-warpgroups must be"), (["--mla-warpgroups", ""], "at least one form"),
])
def test_bad_flags(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        mla_layer_timing.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err
