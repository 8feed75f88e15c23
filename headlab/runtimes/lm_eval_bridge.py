"""lm-evaluation-harness on the model headlab holds in memory (masked, pruned, converted, recovered), through
lm-eval's own HFLM wrapper, with results as a tidy table; and a local rolling-perplexity task for any text.

lm-eval is an optional extra (`pip install 'headlab[lmeval]'`); every entry point says how to install it.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import pandas as pd

from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, _hub_reachable
from headlab.measure.evaluate import check_max_length

INSTALL_HINT = "install the extra: pip install 'headlab[lmeval]' (lm-eval 0.4.13)"
ROLLING_TASK = "headlab_rolling"
ROLLING_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")

# The local rolling task: a jsonl of {"text": ...} documents scored with loglikelihood_rolling and lm-eval's wikitext
# metrics, except that words and bytes are counted on the scored text itself (wikitext counts them on the page
# before its detokenizer; here nothing is detokenized).
_ROLLING_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: text
process_results: !function {name}_metrics.process_results
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""
_ROLLING_METRICS_PY = """import re


def process_results(doc, results):
    (loglikelihood,) = results
    words = len(re.split(r"\\s+", doc["text"]))
    n_bytes = len(doc["text"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
    }
"""


def require_lm_eval():
    """The lm_eval module, or a one-line error saying how to install it."""
    try:
        # optional: lm-eval is the `lmeval` extra; the task manager lives in lm_eval.tasks
        import lm_eval
        import lm_eval.tasks  # noqa: F401
    except ImportError:
        raise HeadlabError(f"tasks= needs lm-eval, which is not installed; {INSTALL_HINT}") from None
    # lm-eval logs warnings (a model object passed as `pretrained`, task overrides) meant for its own CLI.
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    return lm_eval


def write_rolling_task(directory: Path, texts: list[str], name: str = ROLLING_TASK) -> Path:
    """A local lm-eval task (YAML + jsonl + metrics module, no hub) scoring `texts` as documents with
    loglikelihood_rolling; returns the directory to pass as --include-path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    (directory / f"{name}.yaml").write_text(_ROLLING_YAML.format(name=name, data=json.dumps(str(data.resolve()))))
    (directory / f"{name}_metrics.py").write_text(_ROLLING_METRICS_PY)
    return directory


# Long-context retrieval tasks (headlab.measure.long_tasks) as lm-eval generate_until tasks, one per (task, length),
# all tagged LONG_TAG: the same prompts, the same greedy decode cut at the first newline, the same scoring.
LONG_TAG = "headlab_long"
_LONG_YAML = """task: {name}
tag: {tag}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: prompt
doc_to_target: answer
generation_kwargs:
  until:
    - "\\n"
  max_gen_toks: {max_new_tokens}
  do_sample: false
process_results: !function {metrics}.process_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
  - metric: recall
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def long_task_name(task: str, length: int) -> str:
    return f"{LONG_TAG}_{task}_{length}"


def long_task_files(prompts, data_root: Path) -> dict[str, str]:
    """lm-eval task files for long-context prompts (LongPrompt list), by file name: one generate_until task per
    (task, length) whose YAML reads its jsonl from `data_root` (where the files will lie), and a metrics module
    whose process_results is headlab's own scoring (the source of headlab.measure.long_tasks.score, so lm-eval
    needs no headlab import)."""
    import inspect  # start-up: only writing task files reads a function's source

    from headlab.measure.long_tasks import score  # start-up: the long-context tasks only when their files are written

    metrics = f"{LONG_TAG}_metrics"
    files = {
        f"{metrics}.py": "import re\n\n\n"
        + inspect.getsource(score)
        + "\n\ndef process_results(doc, results):\n"
        + "    correct, recall = score(doc['task'], results[0].split('\\n', 1)[0], doc['answers'])\n"
        + "    return {'exact_match': float(correct), 'recall': recall}\n"
    }
    groups: dict[tuple, list] = {}
    for prompt in prompts:
        groups.setdefault((prompt.task, prompt.length), []).append(prompt)
    for (task, length), group in groups.items():
        name = long_task_name(task, length)
        rows = [{**p.record(), "answer": " ".join(p.answers)} for p in group]
        files[f"{name}.jsonl"] = "".join(json.dumps(row) + "\n" for row in rows)
        data = json.dumps(str(Path(data_root).resolve() / f"{name}.jsonl"))
        files[f"{name}.yaml"] = _LONG_YAML.format(
            name=name, tag=LONG_TAG, data=data, max_new_tokens=group[0].max_new_tokens, metrics=metrics
        )
    return files


def write_long_tasks(directory: Path, prompts) -> list[str]:
    """Write long_task_files into `directory` (usable with --include-path); returns the task names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = long_task_files(prompts, directory)
    for name, content in files.items():
        (directory / name).write_text(content)
    return sorted(name.removesuffix(".yaml") for name in files if name.endswith(".yaml"))


def _check_yamls(include_path: Path) -> None:
    """lm-eval skips a task YAML that does not parse without a word; say which one and why instead."""
    from lm_eval.tasks._yaml_loader import load_yaml  # optional: the lmeval extra

    for path in sorted(include_path.rglob("*.yaml")):
        try:
            load_yaml(path, resolve_func=False)
        except Exception as error:  # yaml raises several types (scanner, parser, constructor errors)
            reason = " ".join(str(error).split())[:200]
            raise HeadlabError(f"task YAML {path} does not parse: {reason}") from None


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str | None, include_defaults: bool):
    # Indexing lm-eval's own task tree reads every one of its task YAMLs: build it once per process.
    from lm_eval.tasks import TaskManager  # optional: the lmeval extra

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def task_manager(tasks: list[str], include_path: str | Path | None = None):
    """The TaskManager that knows every name in `tasks`: the local YAMLs alone or lm-eval's task tree alone when
    either suffices (each indexed once per process), both only for a mix. Unknown names are refused with their
    close matches."""
    require_lm_eval()
    if not tasks:
        raise HeadlabError("tasks= is empty; give one or more lm-eval task names")
    local = None
    if include_path is not None:
        path = Path(include_path).expanduser()
        if not path.is_dir():
            raise HeadlabError(f"include_path={include_path} is not a directory")
        _check_yamls(path)
        local = _task_manager(str(path.resolve()), False)
        if all(name in local.all_tasks for name in tasks):
            return local
    defaults = _task_manager(None, True)
    known = set(defaults.all_tasks) | set(local.all_tasks if local else [])
    unknown = [name for name in tasks if name not in known]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
        hint = f"close matches: {', '.join(close)}" if close else "see `lm-eval ls tasks` for the names"
        raise HeadlabError(f"unknown lm-eval task {name!r}; {hint}")
    if local is None or all(name in defaults.all_tasks for name in tasks):
        return defaults
    return _task_manager(str(Path(include_path).expanduser().resolve()), True)


def _go_offline_if_unreachable() -> bool:
    """Without network, put huggingface_hub and datasets in offline mode so a hub data set fails at once with one
    error instead of retrying; returns whether the hub is reachable."""
    if _hub_reachable():
        return True
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        # start-up: datasets loads only where the hub is unreachable and lm-eval is about to read it
        import datasets.config
        import huggingface_hub.constants

        datasets.config.HF_HUB_OFFLINE = True
        huggingface_hub.constants.HF_HUB_OFFLINE = True
    except ImportError:
        pass
    return False


def load_tasks(manager, tasks: list[str]) -> list:
    """Build the tasks (their data sets are read here): a hub data set that cannot be fetched is one line."""
    online = _go_offline_if_unreachable()
    try:
        loaded = manager.load(list(tasks))
    except Exception as error:  # datasets/huggingface_hub raise many types for "not reachable"/"not found"
        reason = " ".join(str(error).split())[:200]
        where = "" if online else "; without network only local tasks (include_path) can run"
        raise HeadlabError(f"cannot load lm-eval task(s) {', '.join(tasks)}: {reason}{where}") from None
    built = []
    for name in tasks:  # the top-level objects, so groups aggregate as in lm-eval's own CLI
        obj = loaded["groups"].get(name) or loaded["tasks"].get(name)
        built.extend([obj] if obj is not None else [])
    if len(built) != len(tasks):  # a tag expands to its tasks
        built = list(loaded["tasks"].values())
    return built


def wrap(loaded: LoadedModel, max_length: int | None = None, batch_size: int = 1):
    """lm-eval's HFLM around the in-memory model and tokenizer (nothing is saved or reloaded)."""
    require_lm_eval()
    from lm_eval.models.huggingface import HFLM  # optional: the lmeval extra

    return HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, max_length=max_length, batch_size=batch_size)


@dataclass
class TaskResults:
    """lm-eval results as a tidy table (one row per task and metric) with what ran in meta."""

    table: pd.DataFrame
    meta: dict = field(default_factory=dict)

    def value(self, task: str, metric: str) -> float:
        row = self.table[(self.table["task"] == task) & (self.table["metric"] == metric)]
        if row.empty:
            raise KeyError(f"{task}/{metric}")
        return float(row["value"].iloc[0])


def results_table(results: dict) -> pd.DataFrame:
    """Rows (task, metric, filter, value, stderr, samples, higher_is_better) from lm-eval's results dict, whose
    keys are "metric,filter" and "metric_stderr,filter"."""
    rows = []
    for task, values in results["results"].items():
        samples = results.get("n-samples", {}).get(task, {}).get("effective")
        better = results.get("higher_is_better", {}).get(task, {})
        for key, value in values.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filter_name = key.split(",", 1)
            stderr = values.get(f"{metric}_stderr,{filter_name}")
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "filter": filter_name,
                    "value": float(value) if isinstance(value, (int, float)) else float("nan"),
                    "stderr": float(stderr) if isinstance(stderr, (int, float)) else float("nan"),
                    "samples": samples,
                    "higher_is_better": better.get(metric),
                }
            )
    columns = ["task", "metric", "filter", "value", "stderr", "samples", "higher_is_better"]
    return pd.DataFrame(rows, columns=columns)


def run_tasks(
    loaded: LoadedModel,
    tasks: list[str],
    *,
    include_path: str | Path | None = None,
    max_length: int | None = None,
    batch_size: int = 1,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 100000,
    manager=None,
) -> TaskResults:
    """lm-eval's simple_evaluate on the in-memory model; max_length None is lm-eval's own default for the model.
    manager: a TaskManager from task_manager() (checks done before the model was loaded)."""
    lm_eval = require_lm_eval()
    if max_length is not None:
        check_max_length(loaded, max_length)
    manager = manager or task_manager(tasks, include_path)
    built = load_tasks(manager, tasks)
    lm = wrap(loaded, max_length, batch_size)
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=built,
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        bootstrap_iters=bootstrap_iters,
        log_samples=False,
    )
    seconds = time.perf_counter() - start
    meta = {
        "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else _version("lm_eval"),
        "tasks": list(tasks),
        "include_path": str(include_path) if include_path is not None else None,
        "max_length": lm.max_length,
        "batch_size": batch_size,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "bootstrap_iters": bootstrap_iters,
        "task_versions": results.get("versions", {}),
        "seconds": seconds,
    }
    return TaskResults(results_table(results), meta)


def _version(package: str) -> str:
    return version(package)


def lm_eval_rolling_perplexity(
    loaded: LoadedModel, texts: list[str], directory: Path, *, max_length: int, batch_size: int = 1
) -> TaskResults:
    """lm-eval's word perplexity, byte perplexity and bits per byte of `texts` (each a document) on the in-memory
    model, through the local rolling task written into `directory`."""
    include = write_rolling_task(directory, texts)
    return run_tasks(
        loaded, [ROLLING_TASK], include_path=include, max_length=max_length, batch_size=batch_size, bootstrap_iters=0
    )


def task_columns(result: TaskResults) -> dict[str, float]:
    """Wide columns for one model's results beside its perplexity (sweep rows): "task/metric" and its
    "task/metric_stderr"; a filter other than lm-eval's "none" is appended as "task/metric/filter"."""
    columns = {}
    for row in result.table.itertuples(index=False):
        name = f"{row.task}/{row.metric}" + ("" if row.filter == "none" else f"/{row.filter}")
        columns[name] = row.value
        columns[f"{name}_stderr"] = row.stderr
    return columns


def metric_columns(table: pd.DataFrame) -> list[str]:
    """The task-metric columns task_columns added to a table (not their stderr)."""
    return [c for c in table.columns if "/" in str(c) and not str(c).endswith("_stderr")]
