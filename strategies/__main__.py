"""Answers the sweep scripts' questions about the registry, one name per line.

python -m strategies compressing           # strategies that evict: every sweep's default list
python -m strategies baseline              # the strategy results are compared against
python -m strategies compressor NAME ...   # each strategy's natural prompt compressor
"""

import sys

import strategies

USAGE = "usage: python -m strategies compressing | baseline | compressor NAME ..."


def answer(argv: list[str]) -> list[str]:
    if argv == ["compressing"]:
        return strategies.compressing_strategies()
    if argv == ["baseline"]:
        return strategies.baseline_strategies()[:1]
    if argv[:1] == ["compressor"] and len(argv) > 1:
        return [strategies.natural_compressor(name) for name in argv[1:]]
    raise ValueError(USAGE)


def main(argv: list[str]) -> int:
    try:
        print("\n".join(answer(argv)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
