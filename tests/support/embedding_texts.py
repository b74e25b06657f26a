"""Texts for the embedding tests: a long question, the same with one word changed (a near duplicate), and
unrelated questions."""

LONG = (
    "How do I configure the maximum number of cached entries for the response cache in the picker "
    "when running on Kubernetes with three replicas?"
)
ONE_WORD_CHANGED = LONG.replace("three", "four")
UNRELATED = (
    "Write a short poem about the ocean at night in the style of a sea shanty.",
    "How do I bake sourdough bread at home with a cast iron pot?",
    "Which planets of the solar system have rings, and what are the rings made of?",
)
