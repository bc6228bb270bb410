"""Chat and code prompt sets for the default pair, with a fixed train / held-out split.

The draft is distilled on the target's answers to the *training* prompts
(``scripts/distill_draft.py``); the benchmark and the draft's model card use
only the *held-out* prompts. The split is by subject, not by prompt: a held-out
prompt's topic, task or coding problem never appears in training, under any
template. It is a pure function of the lists below (no randomness at import,
no files), so the trainer and the benchmark always agree on it.

Sets:

* ``chat``: everyday questions, explanations and how-tos, single turn, and
  two-turn exchanges (a question, the target's own answer, a follow-up).
* ``code``: short code requests (write, explain, fix) in several languages.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

#: One subject in this many is held out (chosen by a hash of its name, so adding subjects keeps the split).
HELDOUT_ONE_IN = 8


@dataclass(frozen=True)
class ChatPrompt:
    """One conversation to answer: ``messages`` in the OpenAI / transformers chat format."""

    name: str  # "<set>/<template>/<subject>"
    kind: str  # "chat" or "code"
    subject: str
    messages: tuple[dict[str, str], ...] = field(default_factory=tuple)
    follow_up: str | None = None  # a second user turn, asked after the target's first answer

    @property
    def text(self) -> str:
        """The last user message (for tables)."""
        return self.messages[-1]["content"]


TOPICS = """
photosynthesis; black holes; the water cycle; plate tectonics; vaccines; the immune system; DNA; climate change;
inflation; compound interest; the stock market; supply and demand; blockchain; machine learning; neural networks;
the internet; Wi-Fi; GPS; electric cars; solar panels; wind turbines; nuclear power; batteries; the moon landing;
the Roman Empire; the French Revolution; the Renaissance; the Industrial Revolution; World War I; the printing press;
ancient Egypt; the Silk Road; democracy; the United Nations; gravity; relativity; quantum computing; magnets;
electricity; sound waves; rainbows; volcanoes; earthquakes; hurricanes; tides; the seasons; the solar system;
Mars; the Sun; stars; galaxies; the Big Bang; evolution; dinosaurs; bees; coral reefs; rainforests; deserts;
the human heart; sleep; nutrition; vitamins; exercise; stress; meditation; caffeine; sugar; protein; hydration;
antibiotics; viruses; bacteria; allergies; the brain; memory; habits; motivation; procrastination; time management;
public speaking; negotiation; leadership; teamwork; remote work; job interviews; resumes; budgeting; saving money;
credit scores; mortgages; insurance; taxes; retirement plans; index funds; cryptocurrency; recycling; composting;
gardening; houseplants; coffee; tea; bread; cheese; chocolate; wine; olive oil; spices; fermentation; pasta;
sushi; pizza; chess; football; the Olympics; marathons; yoga; cycling; swimming; photography; painting; music theory;
jazz; the piano; the guitar; poetry; novels; Shakespeare; mythology; philosophy; ethics; logic; statistics;
probability; prime numbers; the Pythagorean theorem; calculus; algebra; geometry; fractions; percentages;
encryption; passwords; phishing; firewalls; cloud computing; databases; operating systems; compilers; open source;
version control; APIs; web browsers; search engines; social media; smartphones; 3D printing; robots; drones;
self-driving cars; airplanes; rockets; satellites; submarines; bridges; skyscrapers; concrete; steel; glass;
plastic; paper; cotton; wool; silk; diamonds; gold; salt; water; oxygen; carbon; hydrogen; helium; the periodic table;
chemical reactions; acids and bases; friction; energy; heat; light; lasers; X-rays; microscopes; telescopes;
weather forecasts; clouds; snow; lightning; the ozone layer; oceans; rivers; mountains; glaciers; islands; maps;
time zones; calendars; clocks; money; banks; trade; tariffs; unemployment; cities; villages; public transport;
trains; bicycles; urban planning; architecture; museums; libraries; schools; universities; online learning;
languages; grammar; translation; writing essays; note taking; speed reading; critical thinking; creativity;
happiness; friendship; kindness; empathy; parenting; pets; dogs; cats; birds; horses; whales; sharks; octopuses;
ants; butterflies; trees; flowers; mushrooms; seeds; soil; farming; irrigation; fishing; forests; wildfires;
floods; droughts; pollution; noise; light pollution; plastic waste; electric bikes; smart homes; virtual reality;
video games; movies; television; radio; podcasts; newspapers; advertising; marketing; branding; startups;
small businesses; e-commerce; customer service; supply chains; shipping containers; the post office; elections;
laws; courts; human rights; the census; population growth; aging; retirement; volunteering; charity; tourism;
camping; hiking; first aid; fire safety; earthquake safety; road safety; healthy breakfasts; meal planning;
"""

TASKS = """
bake a loaf of bread; boil an egg; make a cup of tea; brew coffee with a French press; cook rice; make pancakes;
clean a cast iron pan; sharpen a kitchen knife; store fresh herbs; plan meals for a week; pack a suitcase;
plan a road trip; save money on groceries; create a monthly budget; pay off credit card debt; start investing;
write a cover letter; prepare for a job interview; ask for a raise; write a thank-you note; give a good presentation;
learn a new language; memorize a speech; study for an exam; take better notes; stay focused while studying;
fall asleep faster; wake up early; build a morning routine; drink more water; start running; stretch after exercise;
do a proper push-up; reduce stress; start meditating; stop procrastinating; organize a closet; declutter a room;
clean a bathroom; remove a coffee stain; wash a wool sweater; iron a shirt; sew on a button; change a flat tire;
jump-start a car battery; check tire pressure; ride a bike safely in traffic; fix a leaky faucet; unclog a drain;
hang a picture frame; paint a room; grow tomatoes; care for a succulent; repot a plant; start a compost bin;
train a puppy to sit; introduce a new cat to a home; keep a fish tank clean; take better photos with a phone;
back up a computer; create a strong password; spot a phishing email; speed up a slow laptop; set up a home Wi-Fi network;
write a short story; start a journal; read more books; make new friends in a new city; resolve a conflict with a friend;
apologize sincerely; say no politely; run an effective meeting; give constructive feedback; manage a small team;
start a small business; write a business plan; price a product; negotiate a lower bill; plan a birthday party;
host a dinner party; choose a good watermelon; make a simple salad dressing; make homemade pizza dough;
learn to juggle; learn to play chess; solve a Rubik's cube; start a podcast; write a haiku; prepare for a hike;
set up a tent; build a campfire safely; treat a minor burn; recognize signs of dehydration; prepare for a power outage;
"""

CODE_TASKS = """
reverses a string; checks whether a number is prime; returns the n-th Fibonacci number; computes the factorial of n;
checks whether a string is a palindrome; counts the vowels in a string; finds the largest number in a list;
removes duplicates from a list while keeping order; merges two sorted lists; flattens a nested list;
computes the average of a list of numbers; converts Celsius to Fahrenheit; counts how often each word appears in a text;
checks whether two strings are anagrams; returns the second largest number in a list; sums the digits of an integer;
reverses the words in a sentence; capitalizes the first letter of every word; finds the greatest common divisor of two numbers;
checks whether a year is a leap year; converts a decimal number to binary; performs binary search on a sorted list;
sorts a list with bubble sort; sorts a list with merge sort; implements a stack; implements a queue;
reads a text file and counts its lines; writes a list of dictionaries to a CSV file; parses a JSON string;
validates an email address with a regular expression; generates a random password; returns the prime numbers below n;
rotates a list by k positions; finds the missing number in a list from 1 to n; checks whether brackets are balanced;
computes the length of the longest word in a sentence; transposes a matrix; multiplies two matrices;
finds the intersection of two lists; groups a list of words by their first letter; converts a string to title case;
counts the number of set bits in an integer; checks whether a linked list has a cycle; reverses a linked list;
finds the median of a list; computes the running total of a list; chunks a list into groups of size n;
implements a simple LRU cache; retries a function call up to three times; measures how long a function takes;
removes all whitespace from a string; converts a Roman numeral to an integer; converts an integer to a Roman numeral;
checks whether a number is a perfect square; returns the most common element in a list; zips two lists into a dictionary;
filters the even numbers out of a list; computes the power set of a list; generates all permutations of a string;
finds the longest common prefix of a list of strings; computes the Levenshtein distance between two strings;
validates a Sudoku row; simulates rolling two dice; shuffles a list in place; formats a number with thousands separators;
parses a date string into year, month and day; computes the number of days between two dates; downloads a web page;
"""

CODE_CONCEPTS = """
Python decorators; Python generators; list comprehensions; recursion; closures; exceptions and error handling;
the difference between a list and a tuple in Python; dictionaries in Python; classes and objects; inheritance;
async and await; threads versus processes; the global interpreter lock; virtual environments; type hints;
unit testing; mocking in tests; regular expressions; big O notation; hash tables; linked lists; binary trees;
graphs and breadth-first search; depth-first search; dynamic programming; memoization; sorting algorithms;
SQL joins; database indexes; database transactions; REST APIs; HTTP status codes; JSON; environment variables;
git branches; git rebase versus merge; pull requests; code reviews; continuous integration; Docker containers;
Kubernetes pods; caching; logging; debugging with breakpoints; pointers in C; memory leaks; garbage collection;
JavaScript promises; JavaScript closures; the DOM; CSS flexbox; React components; TypeScript interfaces;
Rust ownership; Go goroutines; Java interfaces; immutability; functional programming; lambda functions;
the map and filter functions; string formatting in Python; reading files in Python; command-line arguments;
"""

CODE_CONCEPT_TEMPLATES = {
    "concept": "Explain {t} with a short code example.",
    "when": "When should I use {t}?",
}

LANGUAGES = ("Python", "Python", "Python", "JavaScript", "Go", "Rust", "Java", "C")

CHAT_TEMPLATES = {
    "what": "Tell me about {t}.",
    "explain": "Explain {t} in simple terms.",
    "two_sentences": "Describe {t} in two sentences.",
    "facts": "Give me three interesting facts about {t}.",
    "why": "Why is {t} important?",
    "kid": "How would you explain {t} to a ten-year-old?",
    "pros_cons": "What are the pros and cons of {t}?",
    "misconception": "What is a common misconception about {t}?",
}

HOWTO_TEMPLATES = {
    "how": "How do I {t}?",
    "steps": "Give me step-by-step instructions to {t}.",
    "tips": "What are some tips to {t}?",
    "mistakes": "What mistakes should I avoid when I try to {t}?",
}

CODE_TEMPLATES = {
    "write": "Write a {lang} function that {t}.",
    "how": "How can I write a {lang} function that {t}?",
    "explain": "Write a short {lang} function that {t}, then explain how it works.",
    "test": "Write a {lang} function that {t}, with a few example calls.",
}

FOLLOW_UPS = (
    "Can you give me an example?",
    "Can you explain that more simply?",
    "Can you summarize that in one sentence?",
    "What should I read to learn more?",
    "Thanks! Can you make it shorter?",
)

CODE_FOLLOW_UPS = (
    "Can you add comments to the code?",
    "What is the time complexity?",
    "Can you write a test for it?",
    "Can you make it shorter?",
)


def _items(block: str) -> list[str]:
    return [s.strip() for s in block.replace("\n", " ").split(";") if s.strip()]


def is_heldout(subject: str) -> bool:
    """True for the subjects kept out of training (a stable hash of the subject)."""
    digest = hashlib.sha256(subject.encode()).digest()
    return digest[0] % HELDOUT_ONE_IN == 0


def _pick(options: tuple[str, ...], key: str) -> str:
    return options[hashlib.sha256(key.encode()).digest()[1] % len(options)]


def all_prompts() -> list[ChatPrompt]:
    """Every prompt of both sets, training and held-out, in a fixed order."""
    out: list[ChatPrompt] = []
    for topic in _items(TOPICS):
        for name, template in CHAT_TEMPLATES.items():
            key = f"chat/{name}/{topic}"
            follow = _pick(FOLLOW_UPS, key) if name in ("what", "explain") else None
            out.append(
                ChatPrompt(
                    key, "chat", topic, ({"role": "user", "content": template.format(t=topic)},), follow
                )
            )
    for task in _items(TASKS):
        for name, template in HOWTO_TEMPLATES.items():
            key = f"chat/howto-{name}/{task}"
            follow = _pick(FOLLOW_UPS, key) if name == "how" else None
            out.append(
                ChatPrompt(key, "chat", task, ({"role": "user", "content": template.format(t=task)},), follow)
            )
    for task in _items(CODE_TASKS):
        for name, template in CODE_TEMPLATES.items():
            key = f"code/{name}/{task}"
            for variant in ("", "/2"):
                lang = _pick(LANGUAGES, key + variant)
                follow = _pick(CODE_FOLLOW_UPS, key + variant) if name == "write" else None
                content = template.format(t=task, lang=lang)
                message = {"role": "user", "content": content}
                out.append(ChatPrompt(f"{key}{variant}", "code", task, (message,), follow))
    for concept in _items(CODE_CONCEPTS):
        for name, template in CODE_CONCEPT_TEMPLATES.items():
            key = f"code/{name}/{concept}"
            message = {"role": "user", "content": template.format(t=concept)}
            out.append(ChatPrompt(key, "code", concept, (message,), _pick(CODE_FOLLOW_UPS, key)))
    return out


def training_prompts() -> list[ChatPrompt]:
    return [p for p in all_prompts() if not is_heldout(p.subject)]


def heldout_prompts(kind: str, n: int | None = None) -> list[ChatPrompt]:
    """Held-out prompts of one set (``"chat"`` or ``"code"``), single turn, spread over subjects.

    The first ``n`` in an order that cycles through the subjects, so a small ``n``
    still covers many of them.
    """
    if kind not in ("chat", "code"):
        raise ValueError(f"kind must be 'chat' or 'code', got {kind!r}")
    pool = [p for p in all_prompts() if p.kind == kind and is_heldout(p.subject)]
    by_subject: dict[str, list[ChatPrompt]] = {}
    for p in pool:
        by_subject.setdefault(p.subject, []).append(p)
    ordered: list[ChatPrompt] = []
    depth = 0
    while len(ordered) < len(pool):
        for prompts in by_subject.values():
            if depth < len(prompts):
                ordered.append(prompts[depth])
        depth += 1
    return ordered if n is None else ordered[:n]


#: Short standard-library functions (module, name) the ``copy`` set asks the model to repeat.
_COPY_SOURCES = (
    ("shlex", "quote"),
    ("textwrap", "indent"),
    ("fnmatch", "filter"),
    ("posixpath", "commonprefix"),
    ("colorsys", "rgb_to_hsv"),
    ("string", "capwords"),
    ("glob", "has_magic"),
    ("calendar", "leapdays"),
    ("shutil", "_samefile"),
)

_COPY_REQUESTS = (
    "Repeat this Python function exactly as it is, in a code block, with no explanation:",
    "Copy the following code unchanged into a code block:",
)


def copy_prompts(n: int | None = None) -> list[ChatPrompt]:
    """Requests whose answer repeats the code given in the prompt: where speculation pays most.

    The code is the source of short standard-library functions (read from this
    Python's own files, so the prompts need no data file); the answer is a
    verbatim or near-verbatim copy of it, the setting of edits, reformatting and
    quotation. Single turn, in a fixed order.
    """
    import importlib
    import inspect

    out: list[ChatPrompt] = []
    for i, (module, name) in enumerate(_COPY_SOURCES):
        try:
            source = inspect.getsource(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError, OSError, TypeError):  # a Python without that source
            continue
        request = _COPY_REQUESTS[i % len(_COPY_REQUESTS)]
        content = f"{request}\n\n```python\n{source.rstrip()}\n```"
        message = {"role": "user", "content": content}
        out.append(ChatPrompt(f"copy/{module}.{name}", "copy", f"{module}.{name}", (message,)))
    return out if n is None else out[:n]
