"""Long-context retrieval prompts, generated offline and deterministically from a seed, with real text as the haystack.

The tasks (registry LONG_TASKS) follow passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention") and the
needle tasks of RULER (Hsieh et al. 2024): a single needle, several keys of which one is asked for (the others are
distractors), several values under one key (all asked for), and variable tracking (a chain of assignments, every
name in it asked for). The wording is headlab's own; the structure and the scoring are theirs.

A prompt is `header + haystack (with the needles inserted) + question`, built so that it and the task's answer budget
are exactly `length` tokens (RULER counts a sequence so: the prompt has length - max_new_tokens tokens) under the
model's tokenizer (no special tokens, as lm-evaluation-harness's generate_until feeds it) and the first
needle starts at the asked `depth` of the haystack, within one token: depth 0 puts it before the first haystack
token, depth 1 after the last. The haystack is a slice of the corpus in use, at a seeded offset per sample; it is
never a repeated sentence. Torch-free: only the tokenizer runs here (headlab.measure.longctx runs the model).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

from headlab.core.errors import HeadlabError
from headlab.core.registry import Registry

HEADER = (
    "Below is a long text. A few facts to remember are hidden in it; read it and remember them, "
    "you will be asked about them at the end.\n\n"
)
# Words for keys (RULER draws random words as keys); fixed lists keep prompts identical on every machine.
_ADJECTIVES = (
    "amber azure brisk calm cobalt crimson dusty eager faint frosty gentle golden hollow humble icy jolly keen "
    "lively lunar misty noble olive pale quiet rapid rustic silent silver sleepy solar steady stormy sunny swift "
    "tidy velvet violet wild windy young"
).split()
_NOUNS = (
    "anchor badger beacon canyon cedar comet crane delta ember falcon fern harbor heron island jasper kettle "
    "lantern maple meadow mirror orchid otter pebble pepper quarry raven ribbon saddle signal spruce summit "
    "thistle tundra valley walnut willow zephyr"
).split()


@dataclass(frozen=True)
class Needles:
    """What one prompt hides and asks: `facts` (inserted in order; the first at the asked depth), the question that
    ends the prompt and the answers a correct continuation contains."""

    facts: tuple[str, ...]
    question: str
    answers: tuple[str, ...]
    # Where facts after the first go: "random" (seeded depths anywhere: distractors, extra values) or "after"
    # (evenly spaced between the asked depth and the end, in order: a chain read front to back).
    spread: str = "random"


@dataclass(frozen=True)
class LongTask:
    name: str
    help: str
    definition: str
    make: object  # (random.Random) -> Needles
    max_new_tokens: int  # greedy decode budget: the answers and a little slack (the answer is cut at a newline)


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randrange(10 ** (n - 1), 10**n))


def _key(rng: random.Random, avoid=()) -> str:
    while True:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in avoid:
            return key


def _passkey(rng: random.Random) -> Needles:
    value = _digits(rng, 5)
    fact = f" The pass key is {value}. Remember it. {value} is the pass key."
    return Needles((fact,), "\n\nWhat is the pass key? The pass key is", (value,))


def _magic(key: str, value: str) -> str:
    return f" One of the special magic numbers for {key} is: {value}."


def _single(rng: random.Random) -> Needles:
    key, value = _key(rng), _digits(rng, 7)
    question = (
        f"\n\nWhat is the special magic number for {key} mentioned in the text? The special magic number for {key} is"
    )
    return Needles((_magic(key, value),), question, (value,))


def _multikey(rng: random.Random, distractors: int = 3) -> Needles:
    keys = []
    for _ in range(distractors + 1):
        keys.append(_key(rng, keys))
    values = [_digits(rng, 7) for _ in keys]
    question = (
        f"\n\nWhat is the special magic number for {keys[0]} mentioned in the text? "
        f"The special magic number for {keys[0]} is"
    )
    return Needles(tuple(_magic(k, v) for k, v in zip(keys, values)), question, (values[0],))


def _multivalue(rng: random.Random, count: int = 4) -> Needles:
    key = _key(rng)
    values = []
    while len(values) < count:
        value = _digits(rng, 7)
        if value not in values:
            values.append(value)
    question = (
        f"\n\nWhat are all the special magic numbers for {key} mentioned in the text? "
        f"The special magic numbers for {key} are"
    )
    return Needles(tuple(_magic(key, v) for v in values), question, tuple(values))


def _variable(rng: random.Random, taken=()) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken:
            return name


def _vartrack(rng: random.Random, hops: int = 4) -> Needles:
    names = []
    for _ in range(hops + 1):
        names.append(_variable(rng, names))
    value = _digits(rng, 5)
    facts = [f" VAR {names[0]} = {value}."] + [f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    question = (
        f"\n\nFind every variable that is assigned the value {value} in the text above, directly or through other "
        f"variables. Answer: the variables assigned the value {value} are"
    )
    return Needles(tuple(facts), question, tuple(names), spread="after")


LONG_TASKS: Registry[LongTask] = Registry(
    "tasks",
    [
        LongTask(
            "passkey",
            "a 5-digit pass key hidden in the text (Mohtashami & Jaggi 2023)",
            "exact match: the first number generated equals the pass key",
            _passkey,
            12,
        ),
        LongTask(
            "niah_single",
            "one key-value needle, asked by key (RULER niah_single)",
            "exact match: the first number generated equals the 7-digit value",
            _single,
            16,
        ),
        LongTask(
            "niah_multikey",
            "four key-value needles, one asked for, three distractors (RULER niah_multikey)",
            "exact match: the first number generated equals the asked key's value, not a distractor's",
            _multikey,
            16,
        ),
        LongTask(
            "niah_multivalue",
            "four values under one key, all asked for (RULER niah_multivalue)",
            "exact match: every value appears in the generated answer (recall: the share that does)",
            _multivalue,
            48,
        ),
        LongTask(
            "vartrack",
            "a chain of 4 variable assignments, every name asked for (RULER variable tracking)",
            "exact match: every variable of the chain appears in the generated answer (recall: the share that does)",
            _vartrack,
            40,
        ),
    ],
)

DEFAULT_TASKS = ("passkey",)
# In-context copy sequences per length measured beside the prompts (headlab.measure.copying): two forwards.
COPY_SEQUENCES = 2
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
# The grid of --long-context (prune, convert-gqa, convert-mla, sweep, gqa-sweep): a cell is 3 depths x 2 prompts,
# enough to see a rung lose retrieval, cheap enough to ask for (docs/long-context.md).
TRADE_DEPTHS, TRADE_SAMPLES = (0.0, 0.5, 1.0), 2


@dataclass(frozen=True)
class LongPrompt:
    """One prompt: its text is exactly `prompt_tokens` = length - max_new_tokens tokens, so that prompt and answer
    fit `length` positions; the first needle starts at token `needle_token`, which is
    `depth_actual` of the way through the haystack tokens (the asked `depth` within one token)."""

    task: str
    length: int
    depth: float
    sample: int
    text: str
    answers: tuple[str, ...]
    max_new_tokens: int
    prompt_tokens: int
    needle_token: int
    depth_actual: float
    haystack_char_start: int  # where the haystack slice starts in the source text (recorded, reproducible)
    facts: tuple[str, ...] = field(default=())

    def record(self) -> dict:
        """The prompt as a jsonl row (lm-eval task data; headlab's own prompts file)."""
        return {
            "task": self.task,
            "length": self.length,
            "depth": self.depth,
            "sample": self.sample,
            "prompt": self.text,
            "answers": list(self.answers),
            "max_new_tokens": self.max_new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "needle_token": self.needle_token,
            "depth_actual": self.depth_actual,
            "haystack_char_start": self.haystack_char_start,
        }


def score(task: str, generated: str, answers) -> tuple[bool, float]:
    """(correct, recall) of a generated continuation (already cut at its first newline): single-answer tasks compare
    the first number generated with the answer exactly; multi-answer tasks need every answer as a whole word
    (recall is the share present). Same function in lm-eval's task files (long_task_files)."""
    answers = list(answers)
    if len(answers) == 1 and answers[0].isdigit():
        found = re.search(r"\d+", generated)
        hit = found is not None and found.group(0) == answers[0]
        return hit, float(hit)
    present = [re.search(rf"(?<!\w){re.escape(a)}(?!\w)", generated) is not None for a in answers]
    return all(present), sum(present) / len(present)


class Haystack:
    """The source text, tokenized once with character offsets, and where a needle may go: at a token that starts a
    word (so the needle's leading space joins the text as a word would) within one token of the asked position,
    else at that exact token."""

    def __init__(self, tokenizer, text: str, source: str):
        if not getattr(tokenizer, "is_fast", False):
            raise HeadlabError("long-context prompts need a fast tokenizer (token offsets into the text)")
        self.tokenizer = tokenizer
        self.text = text
        self.source = source
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        self.starts = [start for start, _ in encoded["offset_mapping"]]
        self.ends = [end for _, end in encoded["offset_mapping"]]

    @property
    def tokens(self) -> int:
        return len(self.starts)

    def cut(self, token: int) -> int:
        """The character offset where haystack token `token` starts (the text's end past the last token)."""
        return self.starts[token] if token < self.tokens else len(self.text)

    def word_cut(self, position: float, first: int, last: int) -> int:
        """A character offset for a needle at haystack token `position` (fractional), within tokens [first, last]:
        the nearest token boundary within one token of it that starts a word, else the nearest boundary."""
        near = [t for t in range(math.floor(position) - 1, math.ceil(position) + 2) if abs(t - position) <= 1]
        near = sorted((t for t in near if first <= t <= last), key=lambda t: abs(t - position)) or [
            max(first, min(round(position), last))
        ]
        for token in near:
            offset = self.cut(token)
            if offset == len(self.text) or self.text[offset].isspace():
                return offset
        return self.cut(near[0])


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _positions(needles: Needles, depth: float, rng: random.Random) -> list[float]:
    """The haystack depth of each fact: the first at `depth`, the rest by the task's spread."""
    rest = len(needles.facts) - 1
    if needles.spread == "after":
        return [depth + (1.0 - depth) * i / max(rest, 1) for i in range(rest + 1)] if rest else [depth]
    return [depth] + [rng.random() for _ in range(rest)]


def _assemble(haystack: Haystack, start: int, count: int, needles: Needles, depths: list[float]) -> tuple[str, int]:
    """header + haystack tokens [start, start + count) with the facts inserted + question; and the character offset
    of the first fact in the prompt."""
    end = start + count
    cuts = [haystack.word_cut(start + d * count, start, end) for d in depths]
    order = sorted(range(len(cuts)), key=lambda i: (cuts[i], i))
    # The haystack ends where its last token ends: whitespace before the next token belongs to that token.
    begin, finish = haystack.cut(start), haystack.ends[end - 1]
    pieces, position, first_at = [HEADER], begin, None
    for i in order:
        pieces.append(haystack.text[position : cuts[i]])
        if i == 0:
            first_at = sum(len(p) for p in pieces)
        pieces.append(needles.facts[i])
        position = cuts[i]
    pieces.append(haystack.text[position:finish])
    pieces.append(needles.question)
    return "".join(pieces), first_at


def _settle(haystack: Haystack, start: int, count: int, length: int, assemble):
    """(text, first fact's offset, encoding, start) of a haystack slice whose prompt is exactly `length` tokens.
    Pieces joined can tokenize a token or two differently than apart: step the count by the difference; where a
    boundary merges two tokens so that no count fits, move the slice's start on by a token and try again."""
    for first in range(start, min(start + 8, haystack.tokens)):
        n, seen = count, set()
        while n not in seen and 0 < n and first + n <= haystack.tokens:
            seen.add(n)
            text, first_at = assemble(first, n)
            ids = haystack.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            if len(ids["input_ids"]) == length:
                return text, first_at, ids, first
            n += length - len(ids["input_ids"])
    raise HeadlabError(f"could not build a prompt of exactly length={length} tokens from this haystack and tokenizer")


def build_prompt(haystack: Haystack, task: str, length: int, depth: float, sample: int, seed: int) -> LongPrompt:
    """One prompt of exactly `length` tokens (see the module docstring); the needles and the haystack offset come
    from (seed, task, length, depth, sample), so the same arguments give the same prompt on any machine."""
    spec = LONG_TASKS[task]
    rng = random.Random(f"{seed}/{task}/{length}/{depth}/{sample}")
    needles = spec.make(rng)
    depths = _positions(needles, depth, rng)
    tokenizer = haystack.tokenizer
    target = length - spec.max_new_tokens
    overhead = _count(tokenizer, HEADER + "".join(needles.facts) + needles.question)
    count = target - overhead
    if count < 1:
        raise HeadlabError(f"length={length} leaves no room for a haystack: the {task} text alone is {overhead} tokens")
    if haystack.tokens < count + 1:
        raise HeadlabError(
            f"the corpus is too short for a {length}-token haystack: it has {haystack.tokens:,} tokens, "
            f"{count:,} needed; give a longer text (data=) or a shorter length"
        )
    start = rng.randrange(0, max(1, haystack.tokens - count - 16))  # room for the count to settle upwards
    text, first_at, ids, start = _settle(
        haystack, start, count, target, lambda first, n: _assemble(haystack, first, n, needles, depths)
    )
    _check_round_trip(tokenizer, ids["input_ids"], needles)
    needle_token = next(i for i, (_, end) in enumerate(ids["offset_mapping"]) if end > first_at)
    # Haystack tokens before the first fact (less the header and any fact placed earlier) over all haystack tokens.
    earlier = [f for f, d in zip(needles.facts[1:], depths[1:]) if d < depths[0]]
    placed = needle_token - _count(tokenizer, HEADER) - sum(_count(tokenizer, f) for f in earlier)
    depth_actual = min(1.0, max(0.0, placed / max(1, target - overhead)))
    return LongPrompt(
        task=task,
        length=length,
        depth=depth,
        sample=sample,
        text=text,
        answers=needles.answers,
        max_new_tokens=spec.max_new_tokens,
        prompt_tokens=target,
        needle_token=needle_token,
        depth_actual=depth_actual,
        haystack_char_start=haystack.cut(start),
        facts=needles.facts,
    )


def _check_round_trip(tokenizer, ids, needles: Needles) -> None:
    """The answers must survive encode -> decode, or no model could produce them: no unknown token in the prompt's
    needles, and each answer back in the decoded prompt (whitespace aside: some decoders space their tokens)."""
    unknown = tokenizer.unk_token_id
    decoded = "".join(tokenizer.decode(ids).split())
    for answer in needles.answers:
        encoded = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if (unknown is not None and unknown in encoded) or "".join(answer.split()) not in decoded:
            raise HeadlabError(f"the tokenizer cannot round-trip the needle: {answer!r} is lost in encode/decode")


def check_grid(lengths, depths, max_positions: int | None) -> None:
    """Refuse depths outside [0, 1] and lengths (prompt and answer) beyond the model's positions."""
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise HeadlabError(f"depths={depth:g} is outside [0, 1]")
    for length in lengths:
        if length < 1:
            raise HeadlabError(f"lengths={length} must be positive")
        if max_positions is not None and length > max_positions:
            raise HeadlabError(f"lengths={length} exceeds the model's maximum positions ({max_positions})")


def make_prompts(haystack: Haystack, tasks, lengths, depths, samples: int, seed: int = 0) -> list[LongPrompt]:
    """Every (task, length, depth, sample) prompt, in that order."""
    if samples < 1:
        raise HeadlabError(f"samples={samples} must be at least 1")
    return [
        build_prompt(haystack, task, length, depth, sample, seed)
        for task in tasks
        for length in lengths
        for depth in depths
        for sample in range(samples)
    ]


__all__ = [
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "DEFAULT_TASKS",
    "HEADER",
    "Haystack",
    "LONG_TASKS",
    "LongPrompt",
    "LongTask",
    "TRADE_DEPTHS",
    "TRADE_SAMPLES",
    "build_prompt",
    "check_grid",
    "make_prompts",
    "score",
]
