"""Write a tiny random-weight Llama GGUF that the real llama-server loads and serves.

It is both the model that `make run` serves and the fixture of the test suite, so no download is ever
needed. The weights are random, but arranged so that generation only ever picks whole word tokens:
residual dimension 0 is held at a constant 1 through every layer, and output.weight column 0 rewards
word tokens and punishes control and byte tokens. Without that, random byte tokens would produce
invalid UTF-8, which llama-server holds back and clients cannot decode.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

ARCH = "llama"
N_EMBD = 64
N_HEAD = 4
N_LAYER = 2
N_FF = 128
N_CTX_TRAIN = 4096

# SentencePiece marks a preceding space with U+2581.
SPACE = "\u2581"

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "be",
    "this",
    "are",
    "an",
    "or",
    "have",
    "not",
    "which",
    "one",
    "all",
    "were",
    "they",
    "their",
    "there",
    "been",
    "has",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "she",
    "other",
    "its",
    "may",
    "these",
    "about",
    "than",
    "into",
    "some",
    "could",
    "them",
    "time",
    "only",
    "new",
    "two",
    "first",
    "also",
    "over",
    "after",
    "any",
    "then",
    "very",
    "what",
    "such",
    "most",
    "made",
    "where",
    "well",
    "before",
    "must",
    "through",
    "back",
    "years",
    "much",
    "your",
    "way",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "long",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "himself",
    "few",
    "house",
    "use",
    "during",
    "without",
    "again",
    "place",
    "around",
    "however",
    "home",
    "small",
    "found",
    "thought",
    "went",
    "say",
    "part",
    "once",
    "general",
    "high",
    "upon",
    "school",
    "every",
    "don",
    "does",
    "got",
    "united",
    "left",
    "number",
    "course",
    "war",
    "until",
    "always",
    "away",
    "something",
    "fact",
    "though",
    "water",
    "less",
    "public",
    "put",
    "think",
    "almost",
    "hand",
    "enough",
    "far",
    "took",
    "head",
    "yet",
    "government",
    "system",
    "better",
    "set",
    "told",
    "nothing",
    "night",
    "end",
    "why",
    "called",
    "didn",
    "eyes",
    "find",
    "going",
    "look",
    "asked",
    "later",
    "knew",
    "point",
    "next",
    "program",
    "city",
    "business",
    "give",
    "group",
    "toward",
    "young",
    "days",
    "let",
    "room",
    "president",
    "side",
    "social",
    "present",
    "given",
    "several",
    "order",
    "national",
    "second",
    "possible",
    "rather",
    "per",
    "face",
    "among",
    "form",
    "important",
    "often",
    "things",
    "looking",
    "early",
    "white",
    "case",
    "john",
    "become",
    "large",
    "big",
    "need",
    "four",
    "within",
    "felt",
    "along",
    "children",
    "saw",
    "best",
    "church",
    "ever",
    "least",
    "power",
    "development",
    "light",
    "thing",
    "seemed",
    "family",
    "interest",
    "want",
    "members",
    "mind",
    "country",
    "area",
    "others",
    "done",
    "turn",
    "help",
    "open",
    "model",
    "river",
    "stone",
    "cloud",
    "garden",
    "music",
    "paper",
    "window",
    "story",
    "answer",
]

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    # Single characters let input text tokenize without falling back to bytes for common letters.
    singles = [SPACE, *"abcdefghijklmnopqrstuvwxyz", *".,!?"]
    words = [SPACE + w for w in dict.fromkeys(_WORDS)]  # dict keeps order and drops repeats
    for piece in singles + words:
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
    # SentencePiece scores: longer pieces merge first.
    scores = [0.0] * 259 + [float(len(t)) for t in tokens[259:]]
    return tokens, scores, [int(t) for t in types]


def write_demo_model(path: Path, seed: int = 0) -> Path:
    """Write the demo GGUF to `path` (parents created) and return the path."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocabulary()
    n_vocab = len(tokens)

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_name("llm-supervisor demo (random weights)")
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(_CHAT_TEMPLATE)

    def weights(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    ones = np.ones(N_EMBD, dtype=np.float32)
    embedding = weights(n_vocab, N_EMBD)
    embedding[:, 0] = 1.0  # the constant residual dimension
    writer.add_tensor("token_embd.weight", embedding)
    for layer in range(N_LAYER):
        prefix = f"blk.{layer}"
        attn_output = weights(N_EMBD, N_EMBD)
        attn_output[0, :] = 0.0  # nothing writes into dimension 0
        ffn_down = weights(N_EMBD, N_FF)
        ffn_down[0, :] = 0.0
        writer.add_tensor(f"{prefix}.attn_norm.weight", ones)
        writer.add_tensor(f"{prefix}.attn_q.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"{prefix}.attn_k.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"{prefix}.attn_v.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"{prefix}.attn_output.weight", attn_output)
        writer.add_tensor(f"{prefix}.ffn_norm.weight", ones)
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{prefix}.ffn_down.weight", ffn_down)
    writer.add_tensor("output_norm.weight", ones)
    output = (rng.standard_normal((n_vocab, N_EMBD))).astype(np.float32)
    # Whole words beat single letters, and both always beat control and byte tokens.
    is_word = np.array([len(t) > 2 and t.startswith(SPACE) for t in tokens])
    is_letter = np.array([k == gguf.TokenType.NORMAL for k in types]) & ~is_word
    output[:, 0] = np.where(is_word, 20.0, np.where(is_letter, 5.0, -20.0))
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_broken_model(path: Path) -> Path:
    """Write a GGUF whose header is valid but whose tensor data is cut short, so loading fails."""
    good = write_demo_model(path.with_suffix(".tmp"))
    data = good.read_bytes()
    good.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data[: len(data) // 2])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="where to write the GGUF")
    parser.add_argument("--broken", action="store_true", help="write a truncated, unloadable file")
    parser.add_argument("--force", action="store_true", help="rewrite an existing file")
    args = parser.parse_args()
    if args.path.exists() and not args.force:
        print(f"{args.path} exists; keeping it")
        return
    written = write_broken_model(args.path) if args.broken else write_demo_model(args.path)
    print(f"wrote {written} ({written.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
