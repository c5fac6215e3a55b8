"""Prompts written for the forty-fifth session, two a category in the benchmark's seven kinds, none of
them seen by the simulation that chose INCONSISTENT_MARGIN (that used the benchmark's prompts and the
s36 and s44 held-out ones): the margin's check on the machine is judged on these and the benchmark's."""

from __future__ import annotations

Messages = list[dict[str, str]]


def _user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


PROMPTS: dict[str, list[Messages]] = {
    "multi_turn": [
        [
            {"role": "user", "content": "I am baking bread for the first time. Which flour should I buy?"},
            {
                "role": "assistant",
                "content": "Strong white bread flour: its extra protein gives the dough structure.",
            },
            {"role": "user", "content": "How long should I knead it by hand, and how do I know it is done?"},
        ],
        [
            {
                "role": "user",
                "content": "My bicycle chain keeps slipping when I pedal hard. What could it be?",
            },
            {
                "role": "assistant",
                "content": "Often a worn chain or cassette, or a gear cable that needs tension.",
            },
            {"role": "user", "content": "How can I check whether the chain is worn without special tools?"},
        ],
    ],
    "translation": [
        _user(
            "Translate to French: The train to the airport leaves every twenty minutes from platform four."
        ),
        _user("Translate to Italian: We booked a table for six people at eight o'clock on Friday evening."),
    ],
    "summarization": [
        _user(
            "Summarize in two sentences: The town council met on Tuesday to discuss the new cycle lanes on"
            " Market Street. Shop owners said the loss of parking spaces had cut the number of customers,"
            " while cyclists reported that the street felt much safer. The council agreed to add twenty"
            " parking spaces on a nearby side street and to review the cycle lanes again in six months,"
            " using counts of cyclists and a survey of the shops."
        ),
        _user(
            "Summarize briefly: A study followed 2,000 office workers for a year. Those who took a short walk"
            " after lunch reported less tiredness in the afternoon and slept slightly better, but their"
            " weight did not change on average. The authors say the walk is an easy habit to keep, and that"
            " a longer study is needed to see effects on health."
        ),
    ],
    "qa": [
        _user("Why does ice float on water?"),
        _user("What is the difference between a virus and a bacterium?"),
    ],
    "math_reasoning": [
        _user(
            "A shop sells pens at 3 for 2 euros. How much do 18 pens cost, and how many pens can I buy with"
            " 10 euros? Explain step by step."
        ),
        _user(
            "A rectangle is 3 cm longer than it is wide, and its perimeter is 26 cm. What are its sides?"
            " Show your reasoning."
        ),
    ],
    "rag": [
        _user(
            "Document 1: The Riverside museum is closed on Mondays and open 10 am to 5 pm on other days."
            " Document 2: Entry is free for under-18s; adults pay 12 euros, and on the first Sunday of the"
            " month everyone enters free. Document 3: Guided tours start at 11 am and 2 pm.\n\nQuestion:"
            " What would two adults pay on an ordinary Saturday, and when could they join a tour?"
        ),
        _user(
            "Document 1: The Aster kettle holds 1.7 litres and boils a full load in about four minutes."
            " Document 2: It switches off on its own when the water boils or when it is empty. Document 3:"
            " The filter is removable and can be washed under the tap.\n\nQuestion: Is the kettle safe to"
            " leave unattended, and how do I clean the filter?"
        ),
    ],
    "code": [
        _user(
            "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces."
        ),
        _user("Write a Python function that merges two sorted lists into one sorted list, with type hints."),
    ],
}


def heldout_s45() -> list[tuple[str, str, Messages]]:
    """(id, category, messages) for every prompt."""
    return [(f"s45-{cat}-{i + 1}", cat, m) for cat, ms in PROMPTS.items() for i, m in enumerate(ms)]
