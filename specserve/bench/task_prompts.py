"""Held-out prompts of five task kinds beyond chat and code: the speed gate reports each kind.

Written for this benchmark and kept out of every training set (the draft's and the feature head's
data come from :mod:`specserve.prompts.chat`' training subjects and the target's own answers):
each prompt hands the model a text of its own to work on, so the answer leans on the prompt more
than open chat does.

* ``translate``: translate a short passage into another language.
* ``summarize``: summarise a given passage.
* ``passage-qa``: answer a question from a given passage.
* ``arithmetic``: a word problem, solved step by step.
* ``rewrite``: rewrite a given text in another register.
"""

from __future__ import annotations

from specserve.prompts.chat import ChatPrompt

_TRANSLATE = (
    ("German", "The ferry leaves the harbour at seven every morning, except on Sundays, when the first boat "
     "waits until nine. Passengers with bicycles should board through the rear ramp and keep their tickets "
     "ready for inspection."),
    ("Spanish", "Our library will close for two weeks in August while the old heating system is replaced. "
     "Books that are due during that time can be returned to the drop box beside the main door."),
    ("French", "Please water the tomatoes every second evening, but leave the herbs alone unless the soil "
     "feels completely dry. The spare key is under the blue flowerpot near the shed."),
    ("Italian", "The museum's new wing shows tools that farmers used two hundred years ago, from wooden "
     "ploughs to copper kettles, and children may try some of them in a small workshop."),
    ("Portuguese", "If the printer shows a red light, switch it off, wait ten seconds and switch it on again. "
     "When the light stays red, call the office manager instead of opening the cover."),
    ("Dutch", "The night train was delayed by an hour because a tree had fallen across the line near the "
     "border, so the kitchen car served free soup to everyone who was still awake."),
)

_SUMMARIZE = (
    "The town council met on Tuesday to discuss the future of the old cinema on Market Street. The building "
    "has been empty for six years, and its roof now leaks in several places. One group of residents wants the "
    "council to buy it and turn it into a community arts centre with a small screen, rehearsal rooms and a "
    "cafe. A developer has offered to pay for the repairs if he may build flats on the upper floors. The "
    "council's own engineers estimate that the roof alone will cost more than the town's yearly budget for "
    "parks. No decision was taken; a public meeting is planned for next month.",
    "Mira started keeping bees three summers ago with a single hive borrowed from a neighbour. The first year "
    "she lost half the colony to a cold spell in May, and she harvested almost nothing. The second year she "
    "moved the hive to a sheltered corner of the garden, fed the bees sugar syrup in early spring and joined "
    "a local beekeeping club, where older members showed her how to spot disease. This year she has four "
    "hives, sells honey at the Saturday market and has started teaching a short course for beginners.",
    "A small study followed forty office workers who switched from fixed desks to shared desks for one "
    "year. At the start, most said they worried about noise and about losing personal space. After three "
    "months, complaints about noise had fallen, but many workers said they spent ten to fifteen minutes each "
    "morning finding a free desk and setting up. By the end of the year, teams that had agreed on regular "
    "seating areas reported the highest satisfaction, while those who sat anywhere reported the lowest.",
    "The mountain railway was built in 1912 to carry stone from a quarry near the summit. When the quarry "
    "closed in the 1950s, the line fell silent and the tracks rusted. In 1994 a group of volunteers began "
    "clearing the route on weekends. They rebuilt two bridges, restored an old steam engine found in a "
    "scrapyard, and reopened the first three kilometres for tourists in 2003. Today the line runs to the top "
    "again, and its income pays for the upkeep of the track.",
    "Researchers testing a new type of paving stone found that it could absorb rainwater quickly and release "
    "it slowly into the ground beneath. In a trial car park, puddles disappeared within minutes even during "
    "heavy storms. The stones cost about a third more than ordinary concrete, and they must be swept with a "
    "special machine twice a year so that dirt does not block the pores. The city is now considering them "
    "for streets that flood often.",
    "When the village school lost its only cook, parents took turns preparing lunch for the forty pupils. "
    "At first the menus were simple: soup, bread and fruit. Over the term, the parents began to share "
    "recipes, plan meals a week ahead and buy vegetables from two nearby farms. The children helped set the "
    "tables and clear up. When a new cook was finally hired, she kept the weekly plan and the farm orders, "
    "and invited parents to cook a special meal once a month.",
)

_PASSAGE_QA = (
    ("The lighthouse on Gull Point was first lit in 1868. Its lamp burned whale oil until 1890, then "
     "kerosene until 1931, when the station was connected to the mainland's electricity. The last keeper, "
     "Anders Holm, left in 1978, after which the light ran automatically.",
     "What fuel did the lamp use between 1890 and 1931, and when did the last keeper leave?"),
    ("To apply for a fishing permit, residents must bring proof of address and a photo to the harbour office. "
     "Permits cost 30 euros for a year or 8 euros for a week. Children under fourteen fish free when an adult "
     "with a permit is present. Permits are not sold on public holidays.",
     "How much does a weekly permit cost, and can a twelve-year-old fish without one?"),
    ("The recipe makes twelve rolls. Mix 500 grams of flour with 7 grams of yeast, a teaspoon of salt and 300 "
     "millilitres of warm water. Knead for ten minutes, let the dough rise for an hour, shape the rolls, let "
     "them rise for another thirty minutes, and bake at 220 degrees for eighteen minutes.",
     "How long does the whole process take from kneading to the end of baking?"),
    ("Ticket prices at the observatory depend on the time of day. Morning visits cost 6 pounds for adults "
     "and 3 for children. Evening visits, which include a look through the large telescope when the sky is "
     "clear, cost 10 pounds for adults and 5 for children. If the evening is cloudy, visitors receive a "
     "voucher for another night.",
     "What does a family of two adults and two children pay for an evening visit, and what happens if it is "
     "cloudy?"),
    ("The river festival takes place on the first weekend of July. On Saturday there is a rowing race at "
     "ten, a market along the quay from noon, and fireworks at half past ten in the evening. On Sunday the "
     "boats parade at eleven and the festival ends with a concert in the park at four.",
     "At what times are the rowing race and the concert, and on which days?"),
    ("The hotel's pool opens at six in the morning and closes at nine in the evening, except on Mondays, "
     "when it opens at noon for cleaning. Towels are available at the reception. Children under ten must be "
     "accompanied by an adult, and the sauna is for guests over sixteen only.",
     "When does the pool open on Mondays, and may a fifteen-year-old use the sauna?"),
)

_ARITHMETIC = (
    "A bakery sells muffins for 2.40 each or a box of six for 12.60. Lena needs 20 muffins. What is the "
    "cheapest way to buy them, and how much does she pay? Work it out step by step.",
    "A train leaves at 08:45 and travels 210 kilometres at an average speed of 84 kilometres per hour. At "
    "what time does it arrive? Show each step of the calculation.",
    "A garden is 14 metres long and 9 metres wide. A path 1 metre wide runs all the way around the inside "
    "edge. What is the area of the garden that is not path? Explain step by step.",
    "Sam saves 15 euros in the first week, and each week he saves 5 euros more than the week before. How "
    "much has he saved in total after eight weeks? Solve it step by step.",
    "A tank holds 1,200 litres. One pipe fills it in 40 minutes and another empties it in 60 minutes. If "
    "both are open and the tank starts empty, how long does it take to fill? Show your reasoning step by "
    "step.",
    "A shirt costs 48 dollars. It is reduced by 25 percent, and then a further 10 percent is taken off the "
    "reduced price at the till. What is the final price, and what is the total discount as a percentage of "
    "the original price? Work through it step by step.",
)

_REWRITE = (
    ("a polite, formal email", "hey, the report u sent is missing the numbers for march. need them by "
     "tomorrow or the whole thing gets pushed back again. thx"),
    ("plain language a ten-year-old understands", "The municipality hereby notifies residents that, owing to "
     "scheduled maintenance of the water distribution infrastructure, supply interruptions may occur between "
     "09:00 and 15:00 on the date specified."),
    ("a short, upbeat social media post", "The community garden will hold its annual open day on Saturday. "
     "Visitors can tour the plots, buy seedlings and join a workshop on composting. Entry is free."),
    ("the past tense", "Every morning the old fisherman walks down to the harbour, checks his nets, and talks "
     "with the gulls as if they were his crew. When the fog lifts, he rows out past the breakwater."),
    ("a clear, numbered list of instructions", "First you have to unplug the machine and then once that's done "
     "take off the back panel which has four screws, and after that you can pull out the filter, rinse it "
     "under warm water and let it dry before you put everything back."),
    ("a neutral, factual tone", "This absolutely incredible phone is hands down the best thing ever made, with "
     "a mind-blowing camera and a battery that lasts forever, and anyone who buys anything else is making a "
     "huge mistake."),
)


def _prompt(kind: str, i: int, content: str) -> ChatPrompt:
    return ChatPrompt(f"{kind}/{i}", kind, f"{kind}-{i}", ({"role": "user", "content": content},))


def task_prompts(kind: str, n: int | None = None) -> list[ChatPrompt]:
    """The first ``n`` (None: all) held-out prompts of ``kind`` (one of :data:`KINDS`)."""
    if kind == "translate":
        items = [f"Translate the following text into {lang}:\n\n{text}" for lang, text in _TRANSLATE]
    elif kind == "summarize":
        items = [f"Summarise the following text in two or three sentences:\n\n{text}" for text in _SUMMARIZE]
    elif kind == "passage-qa":
        items = [f"Read the passage and answer the question.\n\nPassage: {p}\n\nQuestion: {q}" for p, q in _PASSAGE_QA]
    elif kind == "arithmetic":
        items = list(_ARITHMETIC)
    elif kind == "rewrite":
        items = [f"Rewrite the following text as {style}:\n\n{text}" for style, text in _REWRITE]
    else:
        raise ValueError(f"unknown task kind {kind!r}; the kinds are {', '.join(KINDS)}")
    return [_prompt(kind, i, text) for i, text in enumerate(items[:n] if n is not None else items)]


#: The task kinds, in the gate's order.
KINDS = ("translate", "summarize", "passage-qa", "arithmetic", "rewrite")
