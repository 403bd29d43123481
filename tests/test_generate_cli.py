"""End-to-end tests of `python -m lingjax.generate` (subprocesses) and of the Engine's request checks."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DSPARK_TINY, LING_TINY
from helpers import golden, golden_model, rel

ROOT = Path(__file__).parent.parent
IDS = ",".join(str(t) for t in golden()["long_ids"][0][:40])


def run_cli(*args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "lingjax.generate", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def gen_json(*args):
    r = run_cli("--checkpoint", str(LING_TINY), "--prompt-ids", IDS, "--max-tokens", "12", "--dtype", "float32",
                "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_spec_methods_give_identical_greedy_tokens():
    plain = gen_json("--spec", "none")
    again = gen_json("--spec", "none")
    assert plain["token_ids"] == again["token_ids"]           # greedy is deterministic
    dspark = gen_json("--draft", str(DSPARK_TINY), "--spec", "dspark")
    fp8_draft = gen_json("--draft", str(DSPARK_TINY), "--spec", "dspark", "--draft-dtype", "fp8")
    mtp = gen_json("--spec", "mtp", "--block-size", "2")
    assert dspark["token_ids"] == plain["token_ids"] == mtp["token_ids"] == fp8_draft["token_ids"]
    assert len(plain["token_ids"]) == 12 and plain["finish_reason"] == "length"
    st = dspark["stats"]
    assert st["steps"] >= 1 and st["drafted"] >= st["accepted"] >= 0
    assert st["accept_length"] == pytest.approx((st["accepted"] + st["steps"]) / st["steps"])


def test_logits_out_matches_model_and_golden(tmp_path):
    out = tmp_path / "logits.npy"
    ids = ",".join(str(t) for t in golden()["long_ids"][0])
    r = run_cli("--checkpoint", str(LING_TINY), "--prompt-ids", ids, "--max-tokens", "1", "--dtype", "float64",
                "--logits-out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape == (96, 512)
    assert rel(logits, golden()["long_logits"]) <= 1e-6


@pytest.mark.parametrize("args, needle", [
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--spec", "bogus"], "invalid choice"),
    (["--temperature"], "expected one argument"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
])
def test_bad_flags_exit_2(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2 and needle in r.stderr and "usage:" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--checkpoint", "/nonexistent/ckpt", "--prompt-ids", "1,2"], "does not exist"),
    (["--checkpoint", str(LING_TINY), "--draft", "/nonexistent/draft", "--prompt-ids", "1,2"], "does not exist"),
    (["--checkpoint", str(LING_TINY), "--spec", "dspark", "--prompt-ids", "1,2"], "needs a draft"),
    (["--checkpoint", str(LING_TINY), "--prompt-ids", "1,99999"], "out of range"),
    (["--checkpoint", str(LING_TINY), "--draft", str(DSPARK_TINY), "--block-size", "16", "--prompt-ids", "1"],
     "larger than the draft"),
    (["--checkpoint", str(LING_TINY), "--draft-dtype", "fp8", "--prompt-ids", "1,2"], "applies to a DSpark draft"),
])
def test_bad_inputs_clear_errors(args, needle):
    r = run_cli(*args, "--quiet")
    assert r.returncode == 1, r.stdout
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_engine_request_checks():
    from lingjax.engine import Engine, RequestError
    from lingjax.spec_decode import SpecConfig
    eng = Engine(golden_model("float32"), None, spec=SpecConfig("none"), max_context=64)
    with pytest.raises(RequestError, match="empty"):
        eng.generate([])
    with pytest.raises(RequestError, match="out of range"):
        eng.generate([1, 512])
    with pytest.raises(RequestError, match="n_ctx=64"):
        eng.generate(list(range(70)))
    with pytest.raises(RequestError, match="exceeds the context"):
        eng.generate([1, 2, 3], max_tokens=100)
    with pytest.raises(RequestError, match="max_tokens must be >= 1"):
        eng.generate([1, 2, 3], max_tokens=0)
    with pytest.raises(RequestError, match="no tokenizer"):
        eng.generate("text")
    r = eng.generate([1, 2, 3], max_tokens=5)
    assert len(r.token_ids) == 5 and r.finish_reason == "length"


def test_draft_that_does_not_fit_is_refused():
    from lingjax.engine import Engine
    from lingjax.model.dspark import from_safetensors
    from lingjax.spec_decode import SpecConfig
    from helpers import tiny_config, random_model
    small = random_model(tiny_config(num_hidden_layers=4), jnp.float32)   # draft taps layer 5, 6
    draft = from_safetensors(DSPARK_TINY, dtype=jnp.float32)
    with pytest.raises(ValueError, match="target_layer_ids"):
        Engine(small, None, draft, spec=SpecConfig("dspark", 8))


def test_stop_string_cuts_text_and_tokens():
    from lingjax.engine import Engine
    from lingjax.spec_decode import SpecConfig
    from lingjax.tokenizer import Tokenizer, build_byte_level_tokenizer
    eng = Engine(golden_model("float32"), Tokenizer(build_byte_level_tokenizer()), spec=SpecConfig("none"))
    full = eng.generate("abc", max_tokens=24)
    ids = full.token_ids
    pairs = [k for k in range(1, len(ids) - 1) if ids[k] < 128 and ids[k + 1] < 128]   # printable bytes
    assert pairs, "the golden model produced no ASCII byte pair to use as a stop string"
    stop = bytes(ids[pairs[0]:pairs[0] + 2]).decode("ascii")
    r = eng.generate("abc", max_tokens=24, stop=[stop])
    cut = full.text.find(stop)
    assert r.finish_reason == "stop" and r.text == full.text[:cut]
    assert r.token_ids == ids[: len(r.token_ids)] and len(r.token_ids) < len(ids)
    assert eng.tokenizer.decode(r.token_ids).endswith(stop)


def test_mesh_flag_gives_identical_tokens_and_clear_errors():
    plain = gen_json("--draft", str(DSPARK_TINY))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    args = ["--checkpoint", str(LING_TINY), "--draft", str(DSPARK_TINY), "--prompt-ids", IDS, "--max-tokens", "12",
            "--dtype", "float32", "--json"]
    r = subprocess.run([sys.executable, "-m", "lingjax.generate", *args, "--mesh", "tp=2"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == plain["token_ids"]
    r = run_cli(*args, "--mesh", "tp=2")            # one device only
    assert r.returncode == 1 and "tp*ep must equal the device count" in r.stderr
