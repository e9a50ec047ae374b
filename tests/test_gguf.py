"""GGUF files in: small Llama GGUF files written here with the ``gguf`` package (no download), read through
``zoo/gguf.py`` into cached model directories, and the errors a user meets."""

import json
import os
import time

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf accelerate)")
pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")

from specdec_ext.zoo import load_models  # noqa: E402
from specdec_ext.zoo.gguf import gguf_model_dir, is_gguf  # noqa: E402

TEXT = ("def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n"
        "for i in range(10):\n    print(i * i)\n") * 20


def tiny_tokenizer():
    """A byte-level BPE of about 300 entries with <s> and </s> at ids 0 and 1."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([TEXT], vocab_size=300, min_frequency=2, special_tokens=["<s>", "</s>"], show_progress=False)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in vocab], merges


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q and k projections (transformers undoes it on load)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, seed: int = 0, qtype=None, arch: str = "llama", head_qtype=None):
    """A 2-layer Llama (hidden 64, 4 query / 2 key-value heads) with random weights and the tiny tokenizer, as GGUF
    (float32 tensors, or ``qtype`` for the matrices; ``head_qtype`` for the embedding and output layer). Returns the
    ``transformers`` model it holds (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, merges = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                        "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}

    def put(name, arr):
        kind = (head_qtype or qtype) if name in ("token_embd.weight", "output.weight") else qtype
        if kind is not None and arr.ndim == 2:
            q = gguf.quants.quantize(arr, kind)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(name, arr)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output.weight", sd["lm_head.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    for i in range(2):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], 4))
        put(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], 2))
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny.gguf"
    model = write_llama_gguf(path)
    return path, model, root / "cache"


def test_a_gguf_file_loads_as_the_model_it_holds_and_is_cached(tiny):
    path, model, cache = tiny
    d = gguf_model_dir(path, cache=cache, log=lambda m: None)
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file()
    cfg = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == 2 and cfg["num_key_value_heads"] == 2
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    x = torch.tensor([[0, 5, 17, 42, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=1e-5)
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert gguf_model_dir(path, cache=cache, log=lambda m: pytest.fail("converted twice")) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime


def test_load_models_takes_gguf_paths_with_the_files_tokenizer_and_chat_template(tiny, monkeypatch):
    path, model, cache = tiny
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    pair = load_models(path, path, target_dtype=torch.float32)
    tok = pair.tokenizer
    ids = tok("def add(a, b):")["input_ids"]
    assert tok.decode(ids).endswith("def add(a, b):") and max(ids) < 300
    assert "assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                   add_generation_prompt=True)
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(pair.target(x).logits, model(x).logits, rtol=0, atol=1e-5)


def test_a_quantized_gguf_dequantizes_as_the_gguf_package_does(tmp_path):
    path = tmp_path / "q8.gguf"
    write_llama_gguf(path, seed=1, qtype=gguf.GGMLQuantizationType.Q8_0)
    d = gguf_model_dir(path, cache=tmp_path / "cache", log=lambda m: None)
    from safetensors.torch import load_file

    got = load_file(str(d / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(got.shape)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)).float())


def test_q4_weights_are_a_q4_1_files_own_blocks(tmp_path, monkeypatch):
    """weights="q4" on a Q4_1 file: the decoder layers' weights requantize to the file's own q, d and m (every block),
    so the model's values are the file's exactly; its lean step reads them as 4-bit blocks."""
    from specdec_ext import ops
    from specdec_ext.engine import weights
    from specdec_ext.engine.model import LeanModel

    path = tmp_path / "q4_1.gguf"
    write_llama_gguf(path, seed=2, qtype=gguf.GGMLQuantizationType.Q4_1, head_qtype=gguf.GGMLQuantizationType.Q8_0)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    plain = load_models(path, weights="float").target
    pair = load_models(path)  # weights="auto": the file's own blocks
    assert weights.kind(plain) is None
    assert weights.kind(pair.target) == "q4"
    reader = gguf.GGUFReader(str(path))
    raw = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    blocks = np.asarray(raw.data).reshape(-1, 20)  # Q4_1: float16 d, float16 m, 16 bytes of nibbles
    q, d, m = ops.quantize_blocks(plain.model.layers[1].mlp.down_proj.weight)
    assert torch.equal(d.view(-1), torch.from_numpy(blocks[:, 0:2].copy().view(np.float16).reshape(-1)))
    assert torch.equal(m.view(-1), torch.from_numpy(blocks[:, 2:4].copy().view(np.float16).reshape(-1)))
    from specdec_ext import reference

    for name, p in plain.model.layers.named_parameters():
        if name.endswith("proj.weight"):  # held packed: the values its blocks stand for
            held = pair.target.model.layers.get_submodule(name[:-len(".weight")])
            assert torch.equal(reference.unpack_linear_weight(held.packed, held.out_features), p), name
    lean = LeanModel(pair.target, "target")
    assert lean.panels[0].down.dtype == torch.uint8 and lean.head_panels.shape[2] == 544  # Q8_0 blocks
    bf16 = load_models(path, target_dtype=torch.bfloat16).target  # packed before the cast
    assert bf16.dtype == torch.bfloat16 and LeanModel(bf16, "target").panels[1].down is weights.panels(bf16)[0][1][3]
    rope = bf16.model.rotary_emb.inv_freq  # kept in float32, as from_pretrained(dtype=bfloat16) keeps it
    assert rope.dtype == torch.float32 and torch.equal(rope, plain.model.rotary_emb.inv_freq)
    assert all(torch.equal(a, b) for a, b in zip(weights.panels(bf16)[0][1], lean.panels[1]))


@pytest.mark.parametrize("qtype", [None, "Q8_0", "Q4_1"])
def test_auto_weights_keep_float_where_the_blocks_would_not_be_the_files(tmp_path, monkeypatch, qtype):
    """weights="auto" holds a GGUF target as blocks only where that is exactly the file (Q4_1 layers and a Q8_0
    output layer): a float32 file, a Q8_0 one and one whose output layer is Q4_1 too keep their float weights; q4
    asked for explicitly quantizes them."""
    from specdec_ext.engine import weights

    path = tmp_path / "t.gguf"
    write_llama_gguf(path, seed=3, qtype=getattr(gguf.GGMLQuantizationType, qtype) if qtype else None)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    assert weights.kind(load_models(path).target) is None
    assert weights.kind(load_models(path, weights="q4").target) == "q4"


def test_a_conversion_reads_the_file_once_and_leaves_the_gguf_package_as_it_was(tmp_path, tiny, monkeypatch):
    """transformers' loader would open a reader for the tokenizer, the config and the weights (3) and build the tensor
    name map once per module; gguf_model_dir hands it one of each, then puts the package's own back, after a
    failure too."""
    opened, maps = [], []
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: opened.append(a) or reader(*a, **k))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or name_map(*a))
    counting = (gguf.GGUFReader, gguf.get_tensor_name_map)
    path, model, _ = tiny
    d = gguf_model_dir(path, cache=tmp_path / "once", log=lambda m: None)
    assert len(opened) == 1 and len(maps) == 1, (len(opened), len(maps))
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == counting
    from transformers import AutoModelForCausalLM

    x = torch.tensor([[0, 5, 17, 42]])
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=1e-5)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(ValueError, match="could not read it"):
        gguf_model_dir(cut, cache=tmp_path / "cut", log=lambda m: None)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == counting


def test_bad_gguf_files_raise_one_line_errors_naming_the_file(tmp_path, tiny):
    path, _, _ = tiny
    missing = tmp_path / "missing.gguf"
    with pytest.raises(FileNotFoundError, match="missing.gguf: no such GGUF file"):
        gguf_model_dir(missing, cache=tmp_path)
    notgguf = tmp_path / "weights.gguf"
    notgguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=r"weights\.gguf: not a GGUF file"):
        gguf_model_dir(notgguf, cache=tmp_path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(ValueError, match=r"cut\.gguf: transformers' GGUF loader could not read it") as e:
        gguf_model_dir(cut, cache=tmp_path, log=lambda m: None)
    assert "\n" not in str(e.value)
    other = tmp_path / "other.gguf"
    write_llama_gguf(other, arch="nonesuch")
    with pytest.raises(ValueError, match=r"other\.gguf: .*could not read it") as e:
        gguf_model_dir(other, cache=tmp_path, log=lambda m: None)
    assert "\n" not in str(e.value)
    assert is_gguf("a/B.GGUF") and not is_gguf("a/b.safetensors") and not is_gguf(None)


def test_the_cli_takes_a_gguf_target_and_draft(tiny, tmp_path, monkeypatch, capsys):
    from specdec_ext import cli

    path, _, cache = tiny
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    argv = ["generate", "--target", str(path), "--draft", str(path), "--policy", "fixed", "--k", "2", "--prompt",
            "def add(a, b):", "--max-new-tokens", "8", "--target-dtype", "float32", "--draft-dtype", "float32"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert "policy fixed" in err
    assert cli.main(argv[:2] + [str(tmp_path / "nope.gguf")] + argv[3:]) == 2
    err = capsys.readouterr().err
    assert "--target" in err and "nope.gguf: no such GGUF file" in err
