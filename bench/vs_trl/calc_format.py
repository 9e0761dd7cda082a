"""The calc agent's chat format for TRL, and the scoring and evaluation all three systems share.

TRL's tool support (``GRPOTrainer(tools=...)``) needs two things from a tokenizer: a chat template
that renders assistant ``tool_calls`` and ``tool`` messages, and a response template that parses
tool calls out of a completion. Our tokenizer's template (``rlfleet.common.chat``) is plain ChatML
and our model calls the calculator as ``<calc>37*48+5</calc>``, so this module gives TRL exactly
that: a ChatML template that renders a ``calc`` call as ``<calc>EXPR</calc>`` (the token sequence the
model was warm-started on and rlfleet's sessions hold), and a response template that reads
``<calc>...</calc>`` back as a ``calc`` call. The end-of-turn token is ``<|im_end|>`` (as Qwen's
instruct tokenizers set it), so TRL frames a tool result as ``\\n<|im_start|>tool\\n...<|im_end|>\\n
<|im_start|>assistant\\n`` after the model's ``<|im_end|>``, as rlfleet's ``ChatMLFraming`` does.

Scoring is rlfleet's verifier code itself (``rlfleet.verifier``: transcript -> turns -> kind), and
the held-out evaluation below runs the same agent loop as rlfleet's workers (first tag of a turn,
``max_turns`` tool calls, invalid calls answered with the same error line), so a success rate means
the same thing for TRL as for rlfleet. torch and transformers are imported inside functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from rlfleet.common.chat import IM_END, IM_START
from rlfleet.envkit.actions import (
    FinalAnswer,
    InvalidCall,
    NoAction,
    ToolCall,
    parse_action,
    too_many_calls_error,
)
from rlfleet.envkit.suites import calc

# ChatML, plus assistant tool calls rendered in the calc suite's tag format. An argument other than
# `expression` is rendered as key=value so that a generic tool call still shows all its parts.
TOOL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message.get('tool_calls') %}"
    "{% for call in message['tool_calls'] %}{% set f = call['function'] %}"
    "{{ '<' + f['name'] + '>' }}"
    "{% for key, value in f['arguments'].items() %}"
    "{% if key == 'expression' %}{{ value }}{% else %}{{ key + '=' + (value | string) }}{% endif %}"
    "{% endfor %}"
    "{{ '</' + f['name'] + '>' }}"
    "{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# transformers' response-template format (`tokenizer.response_template`, transformers >= 5.13).
CALC_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<calc>",
            "close_pattern": r"</calc>",
            "repeats": True,
            "content": "text",
            "transform": {"type": "function",
                          "function": {"name": "calc", "arguments": {"expression": "{content}"}}},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

# What rlfleet's worker answers to `<calc>...` without `</calc>` (rlfleet.envkit.actions).
UNCLOSED_CALC_ERROR = "error: malformed tool call: <calc> is not closed by </calc>"


def configure_tokenizer_for_trl(tokenizer) -> None:
    """Gives our tokenizer the tool-calling template, the calc response template and <|im_end|> as EOS."""
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = CALC_RESPONSE_TEMPLATE
    tokenizer.eos_token = IM_END


def make_calc_tool(delay: Callable[[], float], sleep: Callable[[float], None], counter: dict | None = None):
    """The `calc` tool for TRL: the suite's evaluator (what the sandboxed script prints), then the
    workload's extra latency."""

    def calc_tool(expression: str) -> str:
        """Evaluates an integer arithmetic expression with + - * / // % and parentheses.

        Args:
            expression: the expression to evaluate, e.g. 37*48+5
        """
        # The response template reads an unclosed `<calc>...<|im_end|>` as a call; rlfleet's worker
        # answers such a turn with an error line, and so does this tool.
        result = UNCLOSED_CALC_ERROR if IM_END in expression else calc.tool_observation(expression)
        wait = delay()
        if counter is not None:
            counter["calls"] = counter.get("calls", 0) + 1
            counter["latency_s"] = counter.get("latency_s", 0.0) + wait
        if wait > 0:
            sleep(wait)
        return result

    calc_tool.__name__ = "calc"
    return calc_tool


# ---------------------------------------------------------------------------------------------
# Scoring: rlfleet's verifier, on a ChatML transcript


class Score(NamedTuple):
    reward: float
    passed: bool


class CalcScorer:
    """Scores episodes of calc tasks with the verifier's own code (`rlfleet.verifier.kinds`)."""

    def __init__(self, tasks: Sequence) -> None:
        from rlfleet.verifier.kinds import default_kinds

        self.tasks = {t.task_id: t.model_dump(mode="json") for t in tasks}
        self.kinds = default_kinds()

    def score(self, task_id: str, transcript: str, truncated: bool) -> Score:
        """``transcript``: the assistant side of the episode as ChatML (from the first assistant turn)."""
        from rlfleet.verifier.transcript import episode_from_turns, turns_from_text

        task = self.tasks[task_id]
        episode = episode_from_turns(turns_from_text(transcript), task, truncated=truncated)
        verdict = self.kinds.score(task, episode)
        return Score(float(verdict.reward), bool(verdict.passed))


def completion_transcript(tokenizer, completion_ids: Sequence[int]) -> str:
    """A completion (assistant turns and tool results, as TRL builds it) as a ChatML transcript."""
    return f"{IM_START}assistant\n" + tokenizer.decode(list(completion_ids), skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# Held-out evaluation: rlfleet's agent loop, on the model in this process


@dataclass
class _Episode:
    task_id: str
    ids: list[int]
    start: int
    calls: int = 0
    done: bool = False
    truncated: bool = False


def evaluate_success(model, tokenizer, tasks: Sequence, *, temperature: float, seed: int,
                     batch_size: int = 100) -> float:
    """Held-out success of ``model`` on ``tasks`` (one episode each), by rlfleet's episode rules:
    generate a turn (``limits.max_new_tokens``), act on its first tag, at most ``limits.max_turns``
    tool calls and ``max_turns + 1`` turns, then score with the verifier."""
    import torch

    eos_ids = {tokenizer.convert_tokens_to_ids(IM_END), tokenizer.pad_token_id}
    episodes = start_episodes(tokenizer, tasks)
    limits = tasks[0].limits
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        for turn in range(limits.max_turns + 1):
            active = [e for e in episodes if not e.done]
            for i in range(0, len(active), batch_size):
                _eval_turn(model, tokenizer, active[i:i + batch_size], limits, temperature, eos_ids,
                           last_turn=turn == limits.max_turns, generator=generator)
    finally:
        model.train(was_training)
    return success(tokenizer, tasks, episodes)


def start_episodes(tokenizer, tasks: Sequence) -> list[_Episode]:
    """One episode per task, its prompt rendered without the system message (as both systems train)."""
    episodes = []
    for task in tasks:
        ids = _render_ids(tokenizer, [m for m in task.chat_messages() if m["role"] != "system"])
        episodes.append(_Episode(task.task_id, ids, len(ids)))
    return episodes


def success(tokenizer, tasks: Sequence, episodes: Sequence[_Episode]) -> float:
    """The share of `episodes` the verifier passes."""
    scorer = CalcScorer(tasks)
    passed = sum(scorer.score(e.task_id, completion_transcript(tokenizer, e.ids[e.start:]),
                              e.truncated).passed
                 for e in episodes)
    return passed / max(len(episodes), 1)


def _render_ids(tokenizer, messages: list[dict]) -> list[int]:
    from rlfleet.common.chat import render_messages

    return tokenizer(render_messages(messages, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]


def _eval_turn(model, tokenizer, batch: list[_Episode], limits, temperature: float, eos_ids: set[int],
               last_turn: bool, generator) -> None:
    import torch

    pad = tokenizer.pad_token_id
    width = max(len(e.ids) for e in batch)
    input_ids = torch.tensor([[pad] * (width - len(e.ids)) + e.ids for e in batch])
    attention = torch.tensor([[0] * (width - len(e.ids)) + [1] * len(e.ids) for e in batch])
    with torch.no_grad():
        out = _sample(model, input_ids, attention, limits.max_new_tokens, temperature, eos_ids, generator)
    for episode, row in zip(batch, out, strict=True):
        new: list[int] = []
        for token in row.tolist():
            new.append(token)
            if token in eos_ids:
                break
        act_on_turn(episode, new, tokenizer, limits, eos_ids, last_turn)


def act_on_turn(episode: _Episode, new: list[int], tokenizer, limits, eos_ids: set[int] | frozenset[int],
                last_turn: bool) -> None:
    """The worker's rules for one generated turn `new`: an answer (or nothing) ends the episode, a
    call gets the tool's result (or the error line) framed as the next turn's prompt."""
    closed = bool(new) and new[-1] in eos_ids
    episode.ids.extend(new)
    action = parse_action(tokenizer.decode(new, skip_special_tokens=True), [calc.TOOL.name])
    if isinstance(action, FinalAnswer | NoAction):
        episode.done = True
        return
    if isinstance(action, ToolCall):
        episode.calls += 1
        observation = too_many_calls_error(limits.max_turns) if episode.calls > limits.max_turns \
            else calc.tool_observation(action.args)
    else:
        assert isinstance(action, InvalidCall)
        observation = action.error
    if last_turn:
        episode.done = True
        episode.truncated = not closed
        return
    opener = "\n" if closed else IM_END + "\n"
    framed = opener + f"{IM_START}tool\n{observation}{IM_END}\n{IM_START}assistant\n"
    episode.ids.extend(tokenizer(framed, add_special_tokens=False)["input_ids"])


def _sample(model, input_ids, attention, max_new_tokens: int, temperature: float,
            eos_ids: set[int], generator):
    """Plain batched sampling with a KV cache (temperature 0 = greedy); rows that ended keep padding."""
    import torch

    eos = torch.tensor(sorted(eos_ids))
    pad = min(eos_ids)
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=position, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1, :]
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    tokens = []
    for _ in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
        tokens.append(nxt)
        finished |= torch.isin(nxt, eos)
        if bool(finished.all()):
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
        position = position[:, -1:] + 1
        out = model(input_ids=nxt[:, None], attention_mask=attention, position_ids=position,
                    past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
    return torch.stack(tokens, dim=1)
