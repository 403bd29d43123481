"""bench/kernel_module_size.py on the tiny config: Mosaic GPU calls counted from a CUDA cross-lowering."""
import pytest

from bench import kernel_module_size


def test_counts_calls_kernels_and_module_text(tmp_path, capsys):
    rec = kernel_module_size.main(["--tiny", "--layers", "4", "--tokens", "1,9,200", "--out", str(tmp_path)])
    by_t = {r["tokens"]: r for r in rec["rows"]}
    # 3 KDA layers + 1 MLA layer; 2 MoE layers (first_k_dense_replace = 2)
    assert by_t[200]["launches"] == 2 * 3 + 1       # prefill: the KDA prefill kernel's two stages + lm_head
    assert by_t[1]["launches"] == by_t[9]["launches"] > by_t[200]["launches"]
    for r in rec["rows"]:
        # shared_call: one custom call (module copy) per distinct kernel, launched by every layer
        assert r["calls"] == r["distinct_kernels"] < r["launches"]
        assert 0 < r["module_text_bytes"] <= r["program_text_bytes"]
    assert by_t[200]["calls"] == 3                                      # two prefill stages, lm_head
    assert "distinct kernels" in capsys.readouterr().out


def test_call_sizes_parses_hashes():
    text = ('%a = custom_call @mosaic_gpu_v2 {backend_config = {kernel_hash = "ab\\"c", module = "xyz"}}\n'
            'other line\n'
            '%b = custom_call @mosaic_gpu_v2 {backend_config = {kernel_hash = "ab\\"c", module = "xyz"}}\n')
    sizes = kernel_module_size.call_sizes(text)
    assert len(sizes) == 2 and sizes[0][0] == sizes[1][0] == b'ab\\"c'


def test_launches_follow_calls():
    text = """  func.func public @main(%arg0: tensor<1xf32>) -> tensor<1xf32> {
    %0 = call @k(%arg0) : (tensor<1xf32>) -> tensor<1xf32>
    %1 = call @k(%0) : (tensor<1xf32>) -> tensor<1xf32>
    %2 = call @outer(%1) : (tensor<1xf32>) -> tensor<1xf32>
    %3 = stablehlo.custom_call @mosaic_gpu_v2(%2) {backend_config = ""} : (tensor<1xf32>) -> tensor<1xf32>
  }
  func.func private @k(%arg0: tensor<1xf32>) -> tensor<1xf32> {
    %0 = stablehlo.custom_call @mosaic_gpu_v2(%arg0) {backend_config = ""} : (tensor<1xf32>) -> tensor<1xf32>
  }
  func.func private @outer(%arg0: tensor<1xf32>) -> tensor<1xf32> {
    %0 = call @k(%arg0) : (tensor<1xf32>) -> tensor<1xf32>
    %1 = call @k(%0) : (tensor<1xf32>) -> tensor<1xf32>
  }
"""
    assert kernel_module_size.launches(text) == 2 + 2 + 1


@pytest.mark.parametrize("argv,msg", [(["--tokens", "0"], "positive lengths"),
                                      (["--tokens", "a,b"], "comma-separated integers"),
                                      (["--layers", "0"], "--layers >= 1")])
def test_bad_flags(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        kernel_module_size.main(["--tiny"] + argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err
