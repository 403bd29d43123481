"""bench/compile_scaling.py on a CPU host: the programs lower for CUDA (--lower-only); module text
grows with call sites for direct kernel calls and stays put through shared_call."""
import pytest

from bench import compile_scaling


def test_lower_only_rows(tmp_path, capsys):
    rec = compile_scaling.main(["--kernels", "skinny,skinny+shared,xla", "--sites", "1,3", "--lower-only",
                                "--out", str(tmp_path)])
    size = {(r["kernel"], r["sites"]): r["program_text_bytes"] for r in rec["rows"]}
    assert all(r["compile_s"] is None for r in rec["rows"])
    assert size[("skinny", 3)] > 2.5 * size[("skinny", 1)]             # one module copy per call site
    assert size[("skinny+shared", 3)] < 1.2 * size[("skinny+shared", 1)]  # one copy however many sites
    assert size[("xla", 3)] < size[("skinny+shared", 1)]
    assert "per site" not in capsys.readouterr().out


@pytest.mark.parametrize("argv,msg", [(["--kernels", "bogus"], "unknown"), (["--sites", "0"], ">= 1"),
                                      (["--sites", "x"], "comma-separated integers")])
def test_bad_flags(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        compile_scaling.main(argv + ["--lower-only"])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_compiling_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        compile_scaling.main(["--kernels", "xla", "--sites", "1"])
    assert "--lower-only" in capsys.readouterr().err
