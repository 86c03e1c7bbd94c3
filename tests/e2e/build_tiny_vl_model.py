"""Build a tiny random-weight Qwen2-VL model (tokenizer, chat template and image processor included), offline.

The vision suite (`test_vllm_vision_e2e.py`) needs a vision-language model that vLLM serves like any Qwen2-VL:
its processor turns an image into a size-dependent run of `<|image_pad|>` tokens (one per 28x28 pixels after
resizing), the workers key the blocks those tokens fill by the image's hash (`extra_keys`) and the render server
reports the image's hash and placeholder span. Weights are random, so the model writes nonsense; that is all
the suite needs. Small on purpose: 2 text layers of width 128, a 1-block vision tower of width 32.

The image processor is transformers' PIL backend (`Qwen2VLImageProcessorPil`): the CPU torch build has no
matching torchvision (see docs/multimodal-e2e.md), and the PIL backend needs none. Nothing is downloaded from any
hub; the tokenizer is trained on the same seeded corpus as the text suite's, plus Qwen2-VL's vision specials.

Usage: python tests/e2e/build_tiny_vl_model.py OUT_DIR [--force]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_model import MAX_POSITIONS, corpus  # noqa: E402  (run as a script with vLLM's Python)

VOCAB_SIZE = 2048
VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", *VISION]

# One marker per role; a content list renders its image parts as Qwen2-VL does (start, one pad, end: the
# processor expands the pad to the image's token count) and its text parts as they are.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' or p['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# 28x28 pixels per placeholder token (patch 14, merge 2); bounds keep the vision tower's work tiny
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 256


def build_tokenizer(out: Path) -> dict[str, int]:
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
    return {t: tok.token_to_id(t) for t in VISION}


def build_processor(out: Path) -> None:
    """The image processor (PIL backend) and processor configs Qwen2VLProcessor loads from the model dir."""
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorPil", "processor_class": "Qwen2VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}, indent=1))


def build_model(out: Path, vocab_size: int, ids: dict[str, int]) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2VLConfig(
        text_config={
            "vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": MAX_POSITIONS,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "tie_word_embeddings": True,
        },
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True, torch_dtype="float32",
    )
    model = Qwen2VLForConditionalGeneration(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--force", action="store_true", help="rebuild even when OUT already holds a model")
    a = p.parse_args(argv)
    done = a.out / ".complete"
    if done.exists() and not a.force:
        print(f"tiny VL model already built in {a.out}")
        return 0
    tmp = a.out.with_name(a.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ids = build_tokenizer(tmp)
    vocab = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
    build_processor(tmp)
    build_model(tmp, vocab, ids)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(a.out, ignore_errors=True)
    tmp.rename(a.out)  # a half-built directory is never mistaken for a model
    print(f"tiny Qwen2-VL (vocab {vocab}, vision ids {ids}) written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
