"""A small byte-level BPE tokenizer for random test checkpoints, built offline.

Byte-level: every UTF-8 string round-trips (decode(encode(text)) == text) whatever
merges were learned. Ids: 0 <unk>, 1 <s> (bos), 2 </s> (eos), 3-5 chat header and
end-of-turn markers, then the 256 byte tokens, then merges learned from a short
built-in corpus up to the model's vocab_size (a real BPE shortens common words).
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"]
BOS, EOS = "<s>", "</s>"

# Llama-3 style turns; each turn ends with the eos token so generation stops there.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# Our own text; only its letter pairs matter (they become the BPE merges).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tensor parallel runtime splits every
weight matrix of a language model across several GPUs, and each GPU computes a part of
every layer. The partial sums are added together after the attention output projection
and after the down projection of the feed forward network. Hello world! How are you
today? I am fine, thank you. What is the capital of France? The capital of France is
Paris. Once upon a time there was a little model that wanted to generate text quickly.
It read its weights from memory once per token, so memory bandwidth set the speed.
def main():\n    print("hello, world")\n    return 0\n
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159. Questions, answers, and stories.
"""


def check_vocab_size(vocab_size: int) -> None:
    """The byte-level tokenizer needs the special tokens and all 256 bytes."""
    n_base = len(SPECIAL_TOKENS) + 256
    if vocab_size < n_base:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer; "
                         f"need at least {n_base} ({len(SPECIAL_TOKENS)} special + 256 bytes)")


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` with at most `vocab_size` tokens; bos is prepended on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True) * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)])
    assert tok.token_to_id(BOS) == 1 and tok.token_to_id(EOS) == 2
    assert tok.get_vocab_size() <= vocab_size
    return tok


def save_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (chat_template inline) that AutoTokenizer of
    transformers 4 and 5 loads (written by hand: save_pretrained of 5 names a class 4 lacks)."""
    out = Path(out_dir)
    build_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "unk_token": "<unk>", "pad_token": EOS,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
