"""Instruction-style prompts for distilling the draft (scripts/train_draft.py), all written
here so that training needs nothing but this file and the target's GGUF: 24 kinds of request
x 40 topics, crossed and shuffled with a fixed seed. The held-out prompts of
bench/bench_drafts.py are written separately there, in other words, on other topics."""

from __future__ import annotations

import random

TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?",
    "Give me a simple definition of {t}.",
    "Why is {t} important?",
    "Write a four-line poem about {t}.",
    "List five words related to {t}.",
    "Summarize the history of {t} in a few sentences.",
    "What are the pros and cons of {t}?",
    "How would you teach a beginner about {t}?",
    "Write a short story that involves {t}.",
    "What questions do people often ask about {t}?",
    "Describe {t} in one sentence.",
    "Compare {t} with something similar and explain the difference.",
    "What is a common misconception about {t}?",
    "Give me a step-by-step guide to getting started with {t}.",
    "Write a friendly email to a colleague about {t}.",
    "What would the world be like without {t}?",
    "Tell me a joke about {t}.",
    "What are the main parts of {t}?",
    "Write a product description for a book about {t}.",
    "How has {t} changed over the last hundred years?",
    "What skills does someone need to work with {t}?",
    "Can you give an example of {t} in everyday life?",
]

TOPICS = [
    "volcanoes", "the water cycle", "photosynthesis", "the moon", "honey bees", "electricity",
    "the Roman Empire", "chess", "recycling", "the human heart", "rainbows", "gravity",
    "the internet", "baking bread", "dinosaurs", "the ocean tides", "vaccines", "music theory",
    "solar panels", "friendship", "the stock market", "coffee", "bicycles", "glaciers",
    "the printing press", "sleep", "ants", "the Olympic Games", "clouds", "maps",
    "renewable energy", "libraries", "the immune system", "kites", "earthquakes",
    "learning a new language", "trains", "gardening", "the periodic table", "time zones",
]


def training_prompts(seed: int = 0) -> list[str]:
    prompts = [t.format(t=topic) for t in TEMPLATES for topic in TOPICS]
    random.Random(seed).shuffle(prompts)
    return prompts
