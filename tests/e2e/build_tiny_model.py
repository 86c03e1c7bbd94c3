"""Build a tiny random-weight Llama model, a LoRA adapter and a small BPE tokenizer for the vLLM suite, offline.

Run with the vLLM venv's Python (it has torch, transformers and tokenizers); nothing is downloaded from any
hub. The weights are random, so the model writes nonsense, but vLLM loads and serves it like any Llama: it
renders the chat template, tokenizes, fills and reuses its paged KV cache and publishes KV events, which is
all the suite needs. Small on purpose (a few MB, ~1 s per forward on one CPU core) so two workers and a
renderer fit on a 2-core machine. The tokenizer is trained on text generated from a fixed seed, so two
builds give the same vocabulary; the output directory is rebuilt only when missing (or with --force).

Usage: python tests/e2e/build_tiny_model.py OUT_DIR [--force]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

VOCAB_SIZE = 2048
MAX_POSITIONS = 4096
SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

# A plain chat template: one marker per role, an explicit end token, and the assistant marker as the
# generation prompt. Rendering is deterministic, so the render server and the workers agree on token ids.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WORDS = (
    "the of and to in is was for on that with as by at from his her this which or had are not but be have "
    "one all were they their an has been more when who will there so no would if its out about up said into "
    "cache block token prefix worker router engine request tenant salt event replay index model prompt "
    "system user assistant answer question document section chapter report summary policy contract "
    "invoice order customer account payment shipping product service support ticket issue error value"
).split()


def corpus(seed: int = 12, lines: int = 20000) -> list[str]:
    """Deterministic pseudo-English plus digits and punctuation, enough to learn a 2k BPE vocabulary."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        line = " ".join(words)
        out.append(line[0].upper() + line[1:] + rng.choice([".", "?", "!", ",", ":"]))
    return out


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>", model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True, torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(out))


def build_lora(out: Path, rank: int = 8) -> None:
    """A random rank-8 LoRA adapter on q_proj/v_proj in PEFT's on-disk format (what `--lora-modules` loads)."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(1)
    out.mkdir(parents=True)
    weights = {}
    for i in range(2):
        for m in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{i}.self_attn.{m}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, 128) * 0.02
            weights[f"{key}.lora_B.weight"] = torch.randn(2 * 64, rank) * 0.02
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": "tiny-llama", "modules_to_save": None, "use_rslora": False,
        "use_dora": False}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--force", action="store_true", help="rebuild even when OUT already holds a model")
    a = p.parse_args(argv)
    done = a.out / ".complete"
    if done.exists() and not a.force:
        print(f"tiny model already built in {a.out}")
        return 0
    tmp = a.out.with_name(a.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp)
    vocab = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
    build_model(tmp, vocab)
    build_lora(tmp / "lora")
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(a.out, ignore_errors=True)
    tmp.rename(a.out)  # a half-built directory is never mistaken for a model
    print(f"tiny Llama (vocab {vocab}) and its LoRA adapter (lora/) written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
