"""The benchmark's plan: which configurations to measure, and which ratios of a run's rows to judge.

The performance plan (its rows and targets) and the --quick preset are data, in
cache_configs/benchmark/plan.yaml; this module turns them, or the grid flags, into configurations,
and judges rows against the targets generically. It names no strategy: the registry says which
strategies keep every token (measured once, at budget 1.0) and which compressor goes with each.
"""

import itertools
from dataclasses import dataclass
from pathlib import Path

import yaml

import strategies
from cache_args import CACHE_CONFIG_DIR

PLAN_FILE = CACHE_CONFIG_DIR / "benchmark" / "plan.yaml"
GRID_FLAGS = (
    "strategies",
    "budgets",
    "context_lengths",
    "dtypes",
    "modes",
    "cache_bits",
    "prefill_chunk_sizes",
    "questions",
    "batch_sizes",
)
GRID_DEFAULTS = dict(
    strategies=[strategies.DEFAULT_STRATEGY],
    budgets=[0.1],
    context_lengths=[512],
    dtypes=["bfloat16"],
    modes=["eager"],
    cache_bits=[None],
    prefill_chunk_sizes=[None],
    questions=[0],
    batch_sizes=[1],
)
# Flag defaults outside both presets.
OPTION_DEFAULTS = dict(decode_steps=32, warmup=3, compare="none", rounds=1, bound=False)
CONFIGURATION = ("strategy", "budget", "context", "dtype", "cache_bits", "chunk", "questions", "batch")  # less its mode
TARGET_KEYS = {
    "id", "name", "after_failed", "what", "rows", "against", "same", "ratio", "value", "equal",
    "at_least", "at_most", "percent", "judge", "superseded_by",
}  # fmt: skip
JUDGE = ("always", "never", "fast_path")


@dataclass(frozen=True)
class Config:
    impl: str  # "ours" or "hf"
    strategy: str
    budget: float
    context: int
    dtype: str
    mode: str
    cache_bits: int | None
    chunk: int | None = None  # prefill chunk size; None: one pass
    questions: int = 0  # > 0: questions over one compressed context, asked once each way
    batch: int = 1  # sequences decoded together

    @property
    def compressor(self) -> str:
        return strategies.natural_compressor(self.strategy) if self.impl == "ours" else ""

    @property
    def tag(self) -> str:
        bits = f"{self.cache_bits}bit" if self.cache_bits else "nobits"
        tag = f"{self.impl}-{self.strategy}-{self.budget:g}-{self.context}-{self.dtype}-{self.mode}-{bits}"
        tag += f"-chunk{self.chunk}" if self.chunk else ""
        return (
            tag + (f"-{self.questions}q" if self.questions else "") + (f"-batch{self.batch}" if self.batch > 1 else "")
        )


# ------------------------------------------------------------------------------------ the YAML file
def load_plan(path: Path = PLAN_FILE) -> dict:
    """Reads the plan file and checks its targets, so that a typo fails at start, not after a run."""
    plan = yaml.safe_load(Path(path).read_text())
    check_keys("quick", plan["quick"], {*GRID_FLAGS, *OPTION_DEFAULTS})
    check_keys("performance flags", plan["performance"]["flags"], set(OPTION_DEFAULTS))
    for grid in plan["performance"]["rows"]:
        check_keys("performance rows", grid, set(GRID_FLAGS))
    names = set()
    for spec in plan["performance"]["targets"]:
        check_target(spec, plan["performance"]["target_contexts"], names)
        names.add(spec.get("name"))
    return plan


def check_keys(where: str, given: dict, known: set) -> None:
    unknown = set(given) - known
    if unknown:
        raise ValueError(f"{PLAN_FILE.name}: {where}: unknown keys {', '.join(sorted(unknown))}")


def check_target(spec: dict, contexts: dict, earlier_names: set) -> None:
    where = f"target {spec.get('id')} '{spec.get('what')}'"
    check_keys(where, spec, TARGET_KEYS)
    where = f"{PLAN_FILE.name}: {where}"
    if "id" not in spec or "what" not in spec or "rows" not in spec:
        raise ValueError(f"{where}: needs id, what and rows")
    if sum(k in spec for k in ("ratio", "value", "equal")) != 1:
        raise ValueError(f"{where}: needs exactly one of ratio, value, equal")
    if ("ratio" in spec or "equal" in spec) != ("against" in spec):
        raise ValueError(f"{where}: ratio and equal compare with a row `against`; value does not")
    if "equal" not in spec and ("at_least" in spec) == ("at_most" in spec):
        raise ValueError(f"{where}: needs exactly one of at_least, at_most")
    if spec.get("judge", "always") not in JUDGE:
        raise ValueError(f"{where}: judge must be one of {', '.join(JUDGE)}")
    if "after_failed" in spec and spec["after_failed"] not in earlier_names:
        raise ValueError(f"{where}: after_failed names no earlier target")
    for wanted in (spec["rows"], spec.get("against", {})):
        context = wanted.get("context")
        if isinstance(context, str) and context not in contexts:
            raise ValueError(f"{where}: context '{context}' is none of {', '.join(contexts)}")


PLAN = load_plan()
TARGET_CONTEXTS: dict[str, int] = PLAN["performance"]["target_contexts"]
QUICK: dict = PLAN["quick"]


def option_defaults(plan: str, quick: bool) -> dict:
    """Defaults of the measurement flags: the performance plan's, then --quick's over them."""
    performance = PLAN["performance"]["flags"] if plan == "targets" else {}
    preset = {k: v for k, v in QUICK.items() if k not in GRID_FLAGS} if quick else {}
    return {**OPTION_DEFAULTS, **performance, **preset}


# ------------------------------------------------------------------------------------ configurations
def plan_configs(args) -> list[Config]:
    """The rows: the performance plan (grid flags then filter it), or the cartesian product of the grid flags."""
    given = {k: getattr(args, k) for k in GRID_FLAGS if getattr(args, k) is not None}
    if args.plan == "targets":
        subgrids = [filter_subgrid({**GRID_DEFAULTS, **g}, given) for g in PLAN["performance"]["rows"]]
    else:
        preset = {k: v for k, v in QUICK.items() if k in GRID_FLAGS} if args.quick else {}
        subgrids = [{**GRID_DEFAULTS, **preset, **given}]
    return list(dict.fromkeys(cfg for g in subgrids for cfg in grid_configs(g)))


def filter_subgrid(subgrid: dict, given: dict) -> dict:
    """A grid of the plan with only the values the grid flags given allow. A grid of baseline
    strategies only has no budget to filter: they are measured at 1.0 whatever the budgets."""
    baselines_only = set(subgrid["strategies"]) <= set(strategies.baseline_strategies())
    kept = {}
    for axis, values in subgrid.items():
        unfiltered = axis not in given or (axis == "budgets" and baselines_only)
        kept[axis] = [v for v in values if unfiltered or v in given[axis]]
    return kept


def grid_configs(grid: dict) -> list[Config]:
    """The cartesian product of one grid. A baseline strategy keeps every token: it runs once, at
    budget 1.0; a compressing strategy at 1.0 would keep everything too, so that row is skipped, as
    are question rows in batches (they run no batch)."""
    baselines = strategies.baseline_strategies()
    configs = []
    axes = [grid[k] for k in GRID_FLAGS]
    for strategy, budget, ctx, dtype, mode, bits, chunk, questions, batch in itertools.product(*axes):
        if strategy in baselines:
            budget = 1.0
        elif budget == 1.0:
            continue
        if questions and batch > 1:  # question rows answer one context's questions in turn
            continue
        configs.append(Config("ours", strategy, budget, ctx, dtype, mode, bits, chunk, questions, batch))
    return configs


# ------------------------------------------------------------------------------------ targets
def compute_targets(rows: list[dict], contexts: dict[str, int], targets: list[dict] | None = None) -> list[dict]:
    """The plan's targets judged on this run's rows: one line per comparison, each with `passed`
    True, False or None (information, not judged). Lines follow the plan's order of targets and the
    run's order of rows, except that targets of one id on the same rows (or one after_failed
    another) are interleaved row by row: a judged line and the information beside it stand together."""
    targets = PLAN["performance"]["targets"] if targets is None else targets
    rank = {i: n for n, i in enumerate(dict.fromkeys(str(spec["id"]) for spec in targets))}
    groups = line_groups(targets)
    ordered, failed = [], set()
    for n, spec in enumerate(targets):
        for index, row in enumerate(rows):
            if row["error"] or not matches(row, spec["rows"], contexts):
                continue
            if "after_failed" in spec and (spec["after_failed"], index) not in failed:
                continue
            for line, ok in target_lines(spec, row, rows, contexts):
                if ok is False and "name" in spec:
                    failed.add((spec["name"], index))
                ordered.append(((rank[line["target"]], groups[n], index), line))
    return [line for _, line in sorted(ordered, key=lambda pair: pair[0])]


def line_groups(targets: list[dict]) -> list[int]:
    """For each target, the index of the first one its lines are interleaved with (see compute_targets)."""
    groups = []
    for n, spec in enumerate(targets):
        first = next(m for m in range(n + 1) if shown_together(targets[m], spec))
        groups.append(groups[first] if first < n else n)
    return groups


def shown_together(earlier: dict, spec: dict) -> bool:
    follows = "after_failed" in spec and earlier.get("name") == spec["after_failed"]
    return earlier["id"] == spec["id"] and (earlier["rows"] == spec["rows"] or follows)


def target_lines(spec: dict, row: dict, rows: list[dict], contexts: dict[str, int]):
    """(line, outcome of the check) for each row this row is compared with (once without `against`)."""
    others = [None]
    if "against" in spec:
        same = spec.get("same", [])
        others = [r for r in rows if r is not row and not r["error"] and matches(r, spec["against"], contexts)]
        others = [r for r in others if all(r[k] == row[k] for k in same)]
    for other in others:
        value, ok = evaluate(spec, row, other)
        if ok is None:
            continue  # not measured in this row
        bits = f" {row['cache_bits']}-bit" if row["cache_bits"] else ""
        what = spec["what"].format(**row, bits=bits, verdict="==" if ok else "!=")
        if row["batch"] > 1 and "{batch}" not in spec["what"]:
            what += f" (batch {row['batch']})"  # else a run with batches repeats the batch-1 line
        line = dict(target=str(spec["id"]), what=what, value=value, threshold=threshold(spec))
        yield {**line, "passed": judged(spec, row, rows, ok)}, ok


def evaluate(spec: dict, row: dict, other: dict | None) -> tuple[float | None, bool | None]:
    """(value shown, whether it meets the threshold); (None, None) when a value is missing."""
    if "equal" in spec:
        return None, row[spec["equal"]] == other[spec["equal"]]
    column = spec.get("ratio") or spec["value"]
    value = row[column]
    if value is None or (other is not None and not other[column]):
        return None, None
    if other is not None:
        value = value / other[column]
    return value, value >= spec["at_least"] if "at_least" in spec else value <= spec["at_most"]


def judged(spec: dict, row: dict, rows: list[dict], ok: bool) -> bool | None:
    judge = spec.get("judge", "always")
    if judge == "never" or (judge == "fast_path" and not on_fast_path(rows, row)):
        return None
    if "superseded_by" in spec and row[spec["superseded_by"]] is not None:
        return None
    return ok


def on_fast_path(rows: list[dict], row: dict) -> bool:
    """Whether the row is our fastest path for its configuration: compiled, or the run has no
    compiled row of the same configuration."""
    same = {k: row[k] for k in CONFIGURATION}
    compiled = dict(impl="ours", mode="compiled", **same)
    return row["mode"] == "compiled" or not any(not r["error"] and matches(r, compiled, {}) for r in rows)


def threshold(spec: dict) -> str:
    """The target as printed: '>= 2.5x', '>= 65%', 'identical', or '' for information lines."""
    if spec.get("judge") == "never":
        return ""
    if "equal" in spec:
        return "identical"
    sign, limit = (">=", spec["at_least"]) if "at_least" in spec else ("<=", spec["at_most"])
    return f"{sign} {limit:.0%}" if spec.get("percent") else f"{sign} {float(limit)}x"


def matches(row: dict, wanted: dict, contexts: dict[str, int]) -> bool:
    """Whether a row has every wanted value: a value, a list of them, or {not: value(s)}; a context
    may be a name from the plan's target_contexts."""
    for column, value in wanted.items():
        if column == "context" and isinstance(value, str):
            value = contexts[value]
        if not value_matches(row[column], value):
            return False
    return True


def value_matches(actual, wanted) -> bool:
    if isinstance(wanted, dict):
        return not value_matches(actual, wanted["not"])
    if isinstance(wanted, list):
        return actual in wanted
    return actual == wanted
