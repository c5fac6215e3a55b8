"""Prompts written for the forty-fourth session (not the benchmark's), two a category in the
benchmark's seven kinds, for tuning the speculation controller's estimator on text it is not judged on."""

from __future__ import annotations

Messages = list[dict[str, str]]


def _user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


PROMPTS: dict[str, list[Messages]] = {
    "multi_turn": [
        [
            {"role": "user", "content": "I want to start running. How often should I go in the first month?"},
            {
                "role": "assistant",
                "content": "Three short runs a week with a rest day between them is a good start.",
            },
            {
                "role": "user",
                "content": "And how long should each run be? I can jog for about ten minutes now.",
            },
        ],
        [
            {"role": "user", "content": "What is a good houseplant for a dark apartment?"},
            {
                "role": "assistant",
                "content": "A snake plant or a ZZ plant: both tolerate low light and rare watering.",
            },
            {"role": "user", "content": "How do I know when the snake plant needs water?"},
        ],
    ],
    "translation": [
        _user(
            "Translate to German: The library opens at nine in the morning and closes at six in the evening."
        ),
        _user("Translate to Spanish: Please remember to turn off the lights when you leave the office."),
    ],
    "summarization": [
        _user(
            "Summarise the following text in two sentences.\n\nThe harbour town of Eastwick was founded"
            " by fishermen who followed the herring along the coast. For two centuries its fleet of small"
            " wooden boats landed fish that were salted in sheds along the quay and shipped inland by cart."
            " When the railway arrived, fresh fish could reach the cities in a day, and the town built an"
            " ice house and a market hall. The herring grew scarce after the war, and most boats were sold;"
            " today the market hall holds a museum and the quay is lined with cafes that serve visitors who"
            " come for the cliffs and the long sandy beach to the north."
        ),
        _user(
            "Summarise this meeting note in three bullet points.\n\nThe team agreed to move the release"
            " from the first to the third week of May because two payment tests still fail on the staging"
            " server. Maria will fix the tests by Friday. Tom raised that the new search page is slow on"
            " older phones; the team will measure it on three devices before deciding whether to ship it"
            " behind a flag. The next meeting is on Tuesday at ten."
        ),
    ],
    "qa": [
        _user("Why do we see lightning before we hear thunder?"),
        _user("How do vaccines help the body fight infections?"),
    ],
    "math_reasoning": [
        _user("A shop sells pencils at 3 for 75 cents. How much do 14 pencils cost? Explain step by step."),
        _user("A train travels 180 km in 2 hours and 15 minutes. What is its average speed in km/h?"),
    ],
    "rag": [
        _user(
            "Document 1: The Birchwood community pool is open from 7 am to 9 pm on weekdays and from 8 am"
            " to 6 pm at weekends. Document 2: A single swim costs 4 euros for adults and 2 euros for"
            " children under 14; a ten-swim card costs 35 euros. Document 3: Lessons for beginners run on"
            " Saturday mornings and must be booked a week ahead.\n\nQuestion: How much does a family of two"
            " adults and one 10-year-old pay for one swim, and when can they go on Sunday?"
        ),
        _user(
            "Document 1: The Lumen desk lamp has three brightness levels and a colour temperature from"
            " 2700 K to 6500 K. Document 2: It charges over USB-C in two hours and runs for up to 40 hours"
            " on the lowest level. Document 3: The arm folds flat, and the lamp weighs 480 g.\n\nQuestion:"
            " Is the lamp suitable for travel, and how long does it last on one charge?"
        ),
    ],
    "code": [
        _user(
            "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."
        ),
        _user(
            "Write a Python class for a stack with push, pop and peek methods, raising an error when empty."
        ),
    ],
}


def heldout_s44() -> list[tuple[str, str, Messages]]:
    """(id, category, messages) for every prompt."""
    return [(f"s44-{cat}-{i + 1}", cat, m) for cat, ms in PROMPTS.items() for i, m in enumerate(ms)]
