"""The `cache_args` flags, YAML presets, value checks and compatibility rules, all derived from the
strategy registry: a new strategy's hyper-parameters become flags and preset keys, and its facts
become rules, with no edit here."""

import argparse
from pathlib import Path

import yaml

import strategies
from cache import PATTERNS, check_value, layer_cache_lengths, layer_length_values, layer_strategies, spread_over_layers

CACHE_CONFIG_DIR = Path(__file__).resolve().parent / "cache_configs"
LIST_ARGUMENTS = ("max_cache_length", "cache_strategy", "prompt_compression_strategy")


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cache_args (shared by generate.py, eval.py and benchmark.py)")
    names = ", ".join(strategies.strategy_names())
    group.add_argument("--max_cache_length", type=float, nargs="+", default=[1.0],
                       help="per-layer cache size: (0, 1] = fraction of prompt + max_new_tokens, > 1 = tokens; "
                       "a list is spread over layers (default: 1.0)")  # fmt: skip
    group.add_argument("--cache_length_pattern", default="tile", choices=PATTERNS,
                       help="how lengths spread over layers; pyramid/funnel shape one average (default: %(default)s)")  # fmt: skip
    group.add_argument("--cache_strategy", nargs="+", default=[strategies.DEFAULT_STRATEGY],
                       help=f"one or more of {names}, or debug_<name> (default: {strategies.DEFAULT_STRATEGY})")  # fmt: skip
    group.add_argument("--cache_strategy_pattern", default="tile", choices=("tile", "repeat"),
                       help="how a list of strategies spreads over layers (default: %(default)s)")  # fmt: skip
    group.add_argument("--prompt_compression_strategy", nargs="+", default=[strategies.DEFAULT_COMPRESSOR],
                       help=f"one per cache strategy, from {', '.join(strategies.compressors())}; used when the "
                       f"prompt is longer than a cache (default: {strategies.DEFAULT_COMPRESSOR})")  # fmt: skip
    group.add_argument("--prefill_chunk_size", type=int, default=None,
                       help="prefill the prompt N tokens at a time, each chunk competing with the cache for its slots; "
                       "1 = one cache length, then a token per decode step (default: one pass)")  # fmt: skip
    group.add_argument("--feed_long_prompts", dest="prefill_chunk_size", action="store_const", const=1,
                       help="the same as --prefill_chunk_size 1")  # fmt: skip
    group.add_argument("--context_only", action="store_true",
                       help="compress the context before the question is seen (query-agnostic); default: query-aware, "
                       "the question is compressed with the context")  # fmt: skip
    for p in strategies.hyperparameters():
        users = strategies.param_users(p)
        text = f"{'/'.join(users)}: {p.help}" if users else p.help
        if p.type is bool:
            group.add_argument(f"--{p.name}", action="store_true", help=f"{text} (default: off)")
        else:
            group.add_argument(f"--{p.name}", type=p.type, default=p.default, nargs=p.nargs,
                               help=f"{text} (default: {shown(p.default)})")  # fmt: skip
    group.add_argument("--cache_config", default=None,
                       help="a YAML preset in cache_configs/ (name or path); its keys replace the defaults (default: none)")  # fmt: skip


def shown(default) -> str:
    return "none" if default is None else str(default)


def cache_argument_names() -> list[str]:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    return [a.dest for a in parser._actions if a.dest != "help"]


def add_tokenizer_kwargs(cache_kwargs: dict, tokenizer) -> dict:
    """What the chosen strategies need from the tokenizer, under `tokenizer_kwargs`."""
    needed = {}
    for name in cache_kwargs["cache_strategy"]:
        needed.update(strategies.strategy_class(name).tokenizer_kwargs(tokenizer))
    return {**cache_kwargs, "tokenizer_kwargs": needed}


def default_cache_kwargs(**overrides) -> dict:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    kwargs = vars(parser.parse_args([]))
    unknown = set(overrides) - set(kwargs)
    if unknown:
        raise ValueError(f"not cache arguments: {', '.join(sorted(unknown))}")
    return {**kwargs, **overrides}


def load_cache_config(name: str) -> dict:
    """Reads a YAML preset: an existing path (with a slash or .yaml) from anywhere, else a name in cache_configs/."""
    if ("/" in name or name.endswith((".yaml", ".yml"))) and Path(name).is_file():
        path = Path(name)
    else:
        path = (CACHE_CONFIG_DIR / name).with_suffix(".yaml") if not name.endswith(".yaml") else CACHE_CONFIG_DIR / name
        if CACHE_CONFIG_DIR.resolve() not in path.resolve().parents:
            raise ValueError(f"cache config '{name}' is outside {CACHE_CONFIG_DIR}; pass a path instead")
    if not path.is_file():
        choices = ", ".join(sorted(p.stem for p in CACHE_CONFIG_DIR.glob("*.yaml")))
        raise ValueError(f"cache config '{name}' not found; choose from: {choices}, or give a path to a YAML file")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"cache config {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise ValueError(f"cache config {path} must be a mapping of cache arguments")
    allowed = set(cache_argument_names()) - {"cache_config"}
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ValueError(
            f"cache config {path}: '{unknown[0]}' is not a cache argument; allowed: {', '.join(sorted(allowed))}"
        )
    for key in LIST_ARGUMENTS + tuple(p.name for p in strategies.hyperparameters() if p.nargs):
        if key in config and not isinstance(config[key], list):
            config[key] = [config[key]]
    return config


def parse_args_with_cache_config(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Command-line flags beat the preset, the preset beats the defaults."""
    args, _ = parser.parse_known_args(argv)
    if args.cache_config:
        try:
            config = load_cache_config(args.cache_config)
        except ValueError as e:
            parser.exit(2, f"error: {e}\n")
        parser.set_defaults(**config)
    return parser.parse_args(argv)


def check_values(cache_kwargs: dict) -> None:
    """Every cache argument's value against its range, in one line per problem."""
    for length in cache_kwargs["max_cache_length"]:
        check_value("--max_cache_length", length, above=0)
        if length > 1 and length != int(length):
            raise ValueError(f"--max_cache_length {length} is above 1, so a token count: give a whole number")
    for p in strategies.hyperparameters():
        p.validate(cache_kwargs.get(p.name, p.default))
    if cache_kwargs.get("prefill_chunk_size") is not None:
        check_value("--prefill_chunk_size", cache_kwargs["prefill_chunk_size"], minimum=1)
        if cache_kwargs["prefill_chunk_size"] == 1 and cache_kwargs.get("head_budgets") == "adaptive":
            raise ValueError(
                "--head_budgets adaptive shares a compressed prompt, but --prefill_chunk_size 1 feeds it token by "
                "token; give --prefill_chunk_size above 1"
            )
        if cache_kwargs["prefill_chunk_size"] == 1 and cache_kwargs.get("context_only"):
            raise ValueError(
                "--context_only with one token at a time would let the question evict context tokens as it is "
                "fed; give --prefill_chunk_size above 1"
            )


def check_compatibility(cache_kwargs: dict, n_layer: int | None = None, compile: bool = False) -> None:
    """Raises ValueError with a one-line reason for any combination that cannot work."""
    names = cache_kwargs["cache_strategy"]
    compressors = cache_kwargs["prompt_compression_strategy"]
    classes = [strategies.strategy_class(name) for name in names]
    for name in compressors:
        strategies.compressor_class(name)
    if len(compressors) not in (1, len(names)):
        raise ValueError(f"give one --prompt_compression_strategy or one per cache strategy ({len(names)})")
    check_values(cache_kwargs)
    lengths = cache_kwargs["max_cache_length"]
    shaped = cache_kwargs["cache_length_pattern"] in ("pyramid", "funnel")  # some layers get < 1.0
    if n_layer is not None:
        spread_over_layers(names, n_layer, cache_kwargs["cache_strategy_pattern"], "cache_strategy")
        if shaped and len(lengths) != 1:
            raise ValueError(f"--cache_length_pattern {cache_kwargs['cache_length_pattern']} takes one length")
        if not shaped:
            spread_over_layers(lengths, n_layer, cache_kwargs["cache_length_pattern"], "max_cache_length")
    layer_pairs = (
        zip(names, lengths)
        if n_layer is None
        else zip([s for s, _ in layer_strategies(cache_kwargs, n_layer)], layer_length_values(cache_kwargs, n_layer))
    )
    for name, length in layer_pairs:
        # an absolute length would be a cache shorter than the sequence as soon as the prompt outgrows it
        if strategies.strategy_class(name).spans_sequence and (length != 1.0 or shaped):
            raise ValueError(f"the {name} cache spans the whole sequence; use --max_cache_length 1.0 with it")
    for name, cls in zip(names, classes):
        if compile and not cls.compiles:
            raise ValueError(f"the {name} strategy cannot be compiled (its shapes change per head); drop --compile")
    absolute = [v for v in lengths if v > 1]
    if absolute and cache_kwargs["global_tokens"] >= min(absolute):
        raise ValueError(
            f"--global_tokens {cache_kwargs['global_tokens']} exceeds a cache of {int(min(absolute))} slots"
        )
    for name, compressor in zip(names, compressors * len(names) if len(compressors) == 1 else compressors):
        if compressor not in strategies.compatible_compressors(name):
            raise ValueError(
                f"prompt compressor '{compressor}' keeps different tokens per head but cache '{name}' keeps the "
                f"same tokens for all heads; pick one of {', '.join(strategies.compatible_compressors(name))}"
            )
        if cache_kwargs.get("head_budgets") == "adaptive" and not strategies.ranks_heads_apart(name, compressor):
            raise ValueError(
                f"--head_budgets adaptive ranks each head's tokens, but cache '{name}' with compressor '{compressor}' "
                "scores all heads alike; pick a head-specific compressor or --head_budgets uniform"
            )


def check_cache_lengths(
    cache_kwargs: dict, n_layer: int, prompt_length: int, max_new_tokens: int, question_length: int = 0
) -> None:
    """The compatibility checks that need the prompt length: run after tokenizing, before the model loads.
    `question_length`: the tokens after the context, kept room for in --context_only mode."""
    lengths = layer_cache_lengths(cache_kwargs, n_layer, prompt_length, max_new_tokens)
    one_at_a_time = cache_kwargs.get("prefill_chunk_size") == 1
    prefilled = min(prompt_length, min(lengths)) if one_at_a_time else prompt_length
    for length, (_, compressor) in zip(lengths, layer_strategies(cache_kwargs, n_layer)):
        if length <= cache_kwargs["global_tokens"]:
            raise ValueError(f"--global_tokens {cache_kwargs['global_tokens']} exceeds a cache of {length} slots")
        if cache_kwargs.get("context_only") and length - question_length <= cache_kwargs["global_tokens"]:
            raise ValueError(
                f"the question ({question_length} tokens) leaves no room for the context in a {length}-slot cache "
                "with --context_only; raise --max_cache_length"
            )
        if not strategies.compressor_class(compressor).compresses and prefilled > length:
            raise ValueError(
                f"prompt of {prompt_length} tokens does not fit a {length}-slot cache with prompt compression "
                f"'{compressor}'; choose another --prompt_compression_strategy or a larger --max_cache_length"
            )


def relevant_kwargs(cache_kwargs: dict) -> dict:
    """The hyper-parameters the chosen strategies actually read (names result folders)."""
    names = ["cache_strategy", "prompt_compression_strategy"]
    for strategy in cache_kwargs["cache_strategy"]:
        names += strategies.strategy_class(strategy).relevant_kwargs()
    for compressor in cache_kwargs["prompt_compression_strategy"]:
        names += [p.name for p in strategies.compressor_class(compressor).params]
    if len(cache_kwargs["max_cache_length"]) > 1 or cache_kwargs["cache_length_pattern"] in ("pyramid", "funnel"):
        names.append("cache_length_pattern")
    if len(cache_kwargs["cache_strategy"]) > 1:
        names.append("cache_strategy_pattern")
    names += [n for n in ("prefill_chunk_size", "context_only") if cache_kwargs.get(n)]
    if cache_kwargs.get("head_budgets") == "adaptive":
        names.append("head_budgets")
    return {n: cache_kwargs.get(n) for n in dict.fromkeys(names)}
