"""Chat prompts for benchmarks: varied lengths and topics, fixed so runs are comparable."""

CHAT_PROMPTS = [
    "Explain how a paged KV cache works in an LLM inference server.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP?",
    "Give me a recipe for a vegetarian lasagna.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I reverse a linked list in Python? Show code.",
    "What causes the seasons on Earth?",
    "Write a haiku about autumn leaves.",
    "Explain the difference between a process and a thread.",
    "What is the capital of Australia, and why was it chosen?",
    "Describe three tips for better sleep.",
    "How does a bicycle stay upright while moving?",
    "Write a polite email asking a colleague to review my pull request.",
    "What is photosynthesis?",
    "List five interesting facts about octopuses.",
    "Explain recursion to a ten-year-old.",
    "What are the benefits of unit testing?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Why is the sky blue?",
    "Give me a workout plan for beginners, three days a week.",
    "What is the difference between weather and climate?",
    "Write a limerick about a cat who loves coffee.",
    "How do vaccines train the immune system?",
    "Explain what a hash table is and when to use one.",
    "What should I pack for a weekend hiking trip?",
    "Describe the water cycle.",
    "What is the Pythagorean theorem? Give an example.",
    "Write a motivational message for someone starting a new job.",
    "How does compound interest work?",
    "What are black holes?",
    "Suggest three names for a friendly robot and explain each.",
    "How can I make my code easier to read?",
]

SYSTEM_PROMPT_WORDS = (
    "You are a meticulous assistant for a company that builds inference engines. Answer precisely, cite the "
    "relevant component, prefer short paragraphs, never invent numbers, and say when you are unsure. "
)

# Input-grounded work: the answer repeats much of the prompt (quote, rewrite, edit code), where
# n-gram lookup can draft whole phrases.
_PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin spans seven "
    "million square kilometres, of which five and a half million are covered by the rainforest. The "
    "region includes territory belonging to nine nations, and the majority of the forest lies in Brazil."
)
_CODE = (
    "def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n        total += item.price "
    "* item.quantity\n    return total + total * tax_rate\n"
)
GROUNDED_PROMPTS = [
    f"Repeat the following passage word for word:\n\n{_PASSAGE}",
    f"Rewrite this Python function so that it uses a generator expression and sum(). Show the whole "
    f"function.\n\n{_CODE}",
    f"Quote the first two sentences of this text exactly, then say which country holds most of the forest."
    f"\n\n{_PASSAGE}",
    f"Add a docstring to this function and return the full code:\n\n{_CODE}",
]
