from rlfleet.common.chat import IM_END, IM_START
from rlfleet.envkit.corpus import default_corpus
from rlfleet.envkit.demos import generate_demos
from rlfleet.envkit.suite_format import task_to_line
from rlfleet.envkit.suites import calc, code
from rlfleet.envkit.suites.calc_tool import evaluate_expression


def test_corpus_is_deterministic_in_its_seed():
    assert default_corpus(seed=1, n=90) == default_corpus(seed=1, n=90)
    assert default_corpus(seed=1, n=90) != default_corpus(seed=2, n=90)


def test_corpus_is_chatml_dialogues_of_every_difficulty_with_tool_observations():
    corpus = default_corpus(n=90)
    dialogues = [text for text in corpus if text.startswith(IM_START)]
    assert len(dialogues) >= 90
    assert all(text.rstrip().endswith(IM_END) for text in dialogues)
    joined = "".join(corpus)
    assert f"{IM_START}tool\nerror: division by zero{IM_END}" in joined
    assert "(" in joined and "<calc>" in joined and "<answer>" in joined and "<write_file>" in joined


def test_corpus_contains_every_character_the_tasks_demos_and_tools_can_produce():
    seen = set("".join(default_corpus(n=90)))
    produced = set()
    for difficulty in calc.DIFFICULTIES:
        for split in ("train", "heldout", "regression"):
            for task in calc.generate_tasks(split, 50, difficulty=difficulty):
                produced |= set("".join(m.content for m in task.messages))
        for demo in generate_demos(100, imperfection=1.0, difficulty=difficulty):
            produced |= set("".join(m["content"] for m in demo["messages"]))
    for split in ("train", "heldout"):
        for task in code.generate_tasks(split):
            produced |= set(task_to_line(task))
    produced |= set(evaluate_expression("7/3") + evaluate_expression("1+") + evaluate_expression("x"))
    assert produced - seen == set()
