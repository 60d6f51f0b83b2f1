"""Write shardtune's bundled demo datasets into data/ from hand-written seed content.

Run from the repository root: ``python scripts/make_demo_data.py [--out data]``.
The output is deterministic (fixed seed), so re-running it gives byte-identical files.

The samples deliberately mix lengths (a few words up to a few hundred tokens) because the
packing benchmarks measure how well short and long samples share rows.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 20240611

FACTS: list[tuple[str, str, str]] = [
    # (question, short answer, one-sentence elaboration)
    ("What is the capital of France?", "Paris.",
     "Paris sits on the river Seine and has been the French capital for most of the last thousand years."),
    ("What is the capital of Japan?", "Tokyo.",
     "Tokyo became the capital in 1868, when the emperor moved there from Kyoto."),
    ("What is the capital of Canada?", "Ottawa.",
     "Ottawa was chosen partly because it lay between the English- and French-speaking parts of the country."),
    ("What is the capital of Australia?", "Canberra.",
     "Canberra was planned as a compromise between Sydney and Melbourne, which both wanted the title."),
    ("What is the capital of Kenya?", "Nairobi.",
     "Nairobi grew from a railway depot built at the start of the twentieth century."),
    ("What is the capital of Peru?", "Lima.",
     "Lima lies on the Pacific coast and was founded by Spanish settlers in 1535."),
    ("What is the capital of Norway?", "Oslo.",
     "Oslo stands at the head of a long fjord on the south coast of Norway."),
    ("What is the capital of Egypt?", "Cairo.",
     "Cairo spreads along the Nile just south of the point where the river fans out into its delta."),
    ("Which planet is closest to the Sun?", "Mercury.",
     "Mercury circles the Sun in only 88 days, faster than any other planet."),
    ("Which planet is the largest in our solar system?", "Jupiter.",
     "Jupiter is so large that more than a thousand Earths would fit inside it."),
    ("Which planet is known as the red planet?", "Mars.",
     "Mars looks red because iron minerals in its dust have rusted."),
    ("Which planet has the most famous rings?", "Saturn.",
     "Saturn's rings are made of countless pieces of ice and rock, most smaller than a house."),
    ("What is the chemical symbol for gold?", "Au.", "The symbol comes from aurum, the Latin word for gold."),
    ("What is the chemical symbol for iron?", "Fe.", "The symbol comes from ferrum, the Latin word for iron."),
    ("What is the chemical symbol for sodium?", "Na.", "The symbol comes from natrium, an older name for the element."),
    ("What gas do plants take in from the air?", "Carbon dioxide.",
     "Plants use carbon dioxide, water and sunlight to make sugar in a process called photosynthesis."),
    ("What gas do humans need to breathe?", "Oxygen.", "Our cells use oxygen to release the energy stored in food."),
    ("How many legs does a spider have?", "Eight.",
     "Insects have six legs, so the eight legs are an easy way to tell that a spider is not an insect."),
    ("How many legs does an insect have?", "Six.",
     "Every adult insect has six legs attached to the middle part of its body, the thorax."),
    ("What is the largest ocean on Earth?", "The Pacific Ocean.",
     "The Pacific covers about a third of the planet's surface, more than all the land put together."),
    ("What is the longest river in South America?", "The Amazon.",
     "The Amazon carries more water than any other river in the world."),
    ("What is the tallest mountain above sea level?", "Mount Everest.",
     "Everest rises about 8,849 metres above sea level on the border of Nepal and China."),
    ("At what temperature does water boil at sea level?", "100 degrees Celsius.",
     "At higher altitudes the air pressure is lower, so water boils at a lower temperature."),
    ("At what temperature does water freeze?", "0 degrees Celsius.",
     "Salt water freezes at a lower temperature, which is why roads are salted in winter."),
    ("How many days are in a leap year?", "366.",
     "The extra day, 29 February, keeps the calendar in step with the Earth's orbit."),
    ("How many minutes are in an hour?", "60.",
     "The habit of counting in sixties goes back to the ancient Babylonians."),
    ("What is the hardest natural material?", "Diamond.",
     "Diamond is a form of carbon in which every atom is locked tightly to four neighbours."),
    ("What do bees make from nectar?", "Honey.",
     "Bees evaporate water from the nectar and add enzymes until it becomes thick honey."),
    ("What is the fastest land animal?", "The cheetah.",
     "A cheetah can sprint at more than 100 kilometres per hour, but only for a short distance."),
    ("What is the largest mammal?", "The blue whale.",
     "A blue whale can be longer than two buses and its heart alone weighs as much as a small car."),
    ("Who wrote the play Romeo and Juliet?", "William Shakespeare.",
     "Shakespeare wrote it in the 1590s, early in his career."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci.",
     "Leonardo worked on the portrait for years and kept it with him until he died."),
    ("What is the main language spoken in Brazil?", "Portuguese.",
     "Brazil was a Portuguese colony, which is why it speaks Portuguese rather than Spanish."),
    ("What is the freezing point of water in Fahrenheit?", "32 degrees Fahrenheit.",
     "On the Fahrenheit scale water boils at 212 degrees, 180 degrees above its freezing point."),
    ("How many continents are there?", "Seven.",
     "They are Africa, Antarctica, Asia, Australia, Europe, North America and South America."),
    ("What organ pumps blood around the body?", "The heart.",
     "An adult heart beats roughly a hundred thousand times a day."),
    ("What is the smallest prime number?", "2.",
     "It is also the only even prime number, because every other even number can be divided by 2."),
    ("What is the square root of 81?", "9.", "9 multiplied by itself gives 81."),
    ("What does a thermometer measure?", "Temperature.",
     "Many thermometers use a liquid that expands as it warms and rises up a thin tube."),
    ("What force keeps us on the ground?", "Gravity.",
     "Gravity pulls every object with mass towards every other object, and the Earth's pull is the one we feel most."),
]

# Follow-up questions for some facts, used for alpaca `history` and multi-turn chats.
FOLLOW_UPS: dict[str, tuple[str, str]] = {
    "What is the capital of France?": ("Which river runs through it?", "The Seine runs through Paris."),
    "What is the capital of Japan?": (
        "What was the capital before that?", "Kyoto was the capital for more than a thousand years before Tokyo."),
    "Which planet is closest to the Sun?": ("Does it have any moons?", "No. Mercury has no moons at all."),
    "Which planet is the largest in our solar system?": (
        "Name one of its moons.", "Ganymede, which is the largest moon in the solar system."),
    "What is the chemical symbol for gold?": ("And silver?", "Silver is Ag, from the Latin argentum."),
    "What is the largest ocean on Earth?": ("And the smallest?", "The Arctic Ocean is the smallest."),
    "Who wrote the play Romeo and Juliet?": (
        "Name another of his plays.", "Hamlet is one of his best-known tragedies."),
    "What is the fastest land animal?": (
        "What is the fastest bird?", "The peregrine falcon, which can dive at over 300 kilometres per hour."),
    "How many legs does a spider have?": (
        "How many eyes do most spiders have?", "Most spiders have eight eyes, although some have six or fewer."),
    "What do bees make from nectar?": (
        "Where do they store it?", "In wax cells inside the hive, which they seal with a wax cap."),
}

HOW_TO: list[tuple[str, list[str]]] = [
    ("How do I boil an egg?", [
        "Place the egg in a small pan and cover it with cold water.",
        "Bring the water to a boil over medium heat.",
        "Once it boils, turn the heat down and let it simmer for about seven minutes for a firm yolk, or five "
        "minutes for a soft one.",
        "Move the egg into a bowl of cold water so it stops cooking and is easier to peel.",
        "Tap the shell gently on the counter, roll it, and peel it under running water.",
    ]),
    ("How do I keep basil fresh?", [
        "Trim the ends of the stems like you would for cut flowers.",
        "Stand the basil in a glass with a little water.",
        "Keep it on the counter rather than in the fridge, because cold air turns the leaves black.",
        "Change the water every day or two and it should stay fresh for about a week.",
    ]),
    ("How do I fix a flat bicycle tyre?", [
        "Remove the wheel from the frame, releasing the brake first if it is in the way.",
        "Use tyre levers to lift one side of the tyre off the rim and pull out the inner tube.",
        "Pump a little air into the tube and listen or feel for the hole; dipping it in water makes bubbles show "
        "where it is.",
        "Roughen the area with sandpaper, apply glue, wait a minute, and press a patch firmly on top.",
        "Check the inside of the tyre for thorns or glass before putting the tube back, or it will puncture again.",
        "Refit the tyre, inflate it to the pressure printed on its side, and put the wheel back on.",
    ]),
    ("How do I write a good email subject line?", [
        "Say what the email is about in a few specific words.",
        "Put the most important words first, because phones cut long subjects off.",
        "If you need an answer, say so, for example 'Question: budget for March'.",
    ]),
    ("How do I start running?", [
        "Begin with short sessions that mix walking and running, such as one minute of running followed by two "
        "minutes of walking.",
        "Go out three times a week and leave a rest day between sessions.",
        "Run at a pace where you can still talk in short sentences.",
        "Each week, lengthen the running parts a little and shorten the walking parts.",
        "Comfortable shoes matter more than any other equipment.",
        "If something hurts sharply rather than just feeling tired, stop and rest for a few days.",
    ]),
    ("How do I make a cup of tea?", [
        "Boil fresh water.",
        "Put a tea bag or a spoon of loose tea in a warm cup or pot.",
        "Pour the water over it and let it steep for three to five minutes, depending on how strong you like it.",
        "Remove the tea and add milk, lemon or honey if you like.",
    ]),
    ("How do I back up my photos?", [
        "Follow the three-two-one rule: keep three copies, on two different kinds of storage, with one copy "
        "somewhere else.",
        "Copy the photos from your phone or camera onto a computer or an external drive.",
        "Turn on an online backup service so that new photos are copied automatically.",
        "Every few months, open a handful of files from the backup to check that they really work.",
    ]),
    ("How do I remove a coffee stain from a shirt?", [
        "Act quickly: rinse the back of the stain with cold water to push the coffee out of the fabric.",
        "Rub a little liquid laundry detergent into the spot and leave it for five minutes.",
        "Wash the shirt as usual, and check that the stain is gone before putting it in the dryer, because heat "
        "sets stains.",
    ]),
    ("How do I learn new words in a foreign language?", [
        "Learn words in small groups of ten or fifteen instead of long lists.",
        "Use flash cards and review them at growing intervals: after a day, then three days, then a week.",
        "Say each word out loud and use it in a short sentence of your own.",
        "Read simple texts about topics you enjoy, so the words come back in context.",
        "Accept that you will forget some words and relearn them; that is part of the process.",
    ]),
    ("How do I take care of a cactus?", [
        "Give it as much light as you can, ideally a sunny windowsill.",
        "Water it only when the soil has dried out completely, which may be every two or three weeks in summer and "
        "much less in winter.",
        "Use a pot with a drainage hole and a gritty soil mix so the roots never sit in water.",
    ]),
    ("How do I prepare for a job interview?", [
        "Read about the company and the role so you can explain why you want it.",
        "Prepare short stories from your experience that show the skills listed in the advert.",
        "Practise answering common questions out loud, ideally with a friend.",
        "Prepare two or three questions of your own about the team and the work.",
        "Plan your route and arrive a little early.",
    ]),
    ("How do I sharpen a kitchen knife?", [
        "Soak a whetstone in water for ten minutes if it is the kind that needs soaking.",
        "Hold the blade at an angle of about fifteen to twenty degrees to the stone.",
        "Push the edge across the stone from heel to tip, keeping the angle steady, about ten times on each side.",
        "Switch to the finer side of the stone and repeat with lighter pressure.",
        "Rinse and dry the knife, then test it carefully on a sheet of paper.",
    ]),
    ("How do I reduce noise from a squeaky door?", [
        "Find which hinge squeaks by opening the door slowly.",
        "Lift the hinge pin part of the way out and rub a little oil or petroleum jelly on it.",
        "Tap the pin back in and swing the door a few times to spread the oil.",
    ]),
    ("How do I plan a weekly budget?", [
        "Write down your income for the week after tax.",
        "List the fixed costs first, such as rent, transport and bills.",
        "Set an amount for food and everyday spending, and keep the receipts.",
        "Put a small fixed sum into savings at the start of the week rather than saving whatever is left at the end.",
        "At the end of the week, compare what you planned with what you spent and adjust next week's plan.",
    ]),
    ("How do I make bread rise better?", [
        "Check that the yeast is fresh; old yeast is the most common cause of flat bread.",
        "Use water that feels warm on your wrist, not hot, since heat kills yeast.",
        "Knead the dough until it is smooth and springs back when you press it.",
        "Let it rise somewhere warm and draught-free until it has roughly doubled in size.",
    ]),
    ("How do I get better sleep?", [
        "Go to bed and get up at the same time every day, including weekends.",
        "Keep the bedroom dark, quiet and a little cool.",
        "Avoid coffee in the afternoon and heavy meals late in the evening.",
        "Put screens away half an hour before bed and do something calm instead, such as reading.",
        "If you cannot fall asleep after twenty minutes, get up and do something quiet until you feel sleepy.",
    ]),
]

# Topics for plain paragraphs (pre-training text and "summarize" tasks). Sentences are in reading order.
TOPICS: dict[str, tuple[str, list[str]]] = {
    "water cycle": ("Water moves between the sea, the air and the land in a continuous cycle.", [
        "The Sun warms the surface of oceans, lakes and rivers, and some of the water evaporates into the air.",
        "Plants also release water vapour through tiny pores in their leaves.",
        "As the warm, moist air rises, it cools, and the vapour condenses into droplets that form clouds.",
        "When the droplets grow heavy enough, they fall as rain, snow or hail.",
        "Some of the water runs off the land into streams and rivers.",
        "Some soaks into the ground and slowly moves through the soil and rock as groundwater.",
        "Eventually most of it returns to the sea, and the cycle begins again.",
        "The same water has been moving around this cycle for billions of years.",
    ]),
    "bread": ("Bread is made by mixing flour and water and letting yeast make the dough rise before baking.", [
        "People have baked bread for thousands of years, and almost every culture has its own kind.",
        "The simplest loaves need only flour, water, salt and yeast.",
        "When flour is mixed with water, two proteins join to form gluten, a stretchy network.",
        "Kneading the dough makes the gluten stronger and more elastic.",
        "Yeast feeds on the sugars in the flour and gives off carbon dioxide gas.",
        "The gas is trapped by the gluten, so the dough swells like a balloon.",
        "In the oven, the bubbles expand further, then the structure sets and a crust forms.",
        "Sourdough bread uses wild yeast and bacteria instead of packaged yeast, which gives it a tangy flavour.",
        "Flatbreads such as tortillas are made with little or no rising at all.",
    ]),
    "honeybees": ("Honeybees live in large, organised colonies and turn nectar into honey.", [
        "A colony can contain tens of thousands of bees but only one queen.",
        "The queen lays the eggs, sometimes more than a thousand in a single day.",
        "Worker bees are female, and they do almost all of the work of the hive.",
        "Young workers clean cells and feed larvae, while older workers fly out to collect nectar and pollen.",
        "A returning forager can tell others where to find flowers by performing a waggle dance.",
        "The angle of the dance shows the direction of the food, and its length shows the distance.",
        "Bees carry pollen from flower to flower, which helps many crops produce fruit.",
        "In winter the bees cluster together and shiver their muscles to keep the colony warm.",
    ]),
    "volcanoes": ("Volcanoes form where molten rock from deep inside the Earth reaches the surface.", [
        "Below the crust, rock can become hot enough to melt into magma.",
        "Because magma is lighter than the solid rock around it, it slowly rises.",
        "It may collect in a chamber a few kilometres below the surface.",
        "When the pressure grows too high, the magma forces its way up and erupts as lava, ash and gas.",
        "Some volcanoes erupt gently, with rivers of runny lava.",
        "Others explode violently because their magma is thick and full of trapped gas.",
        "Many volcanoes sit along the edges of tectonic plates, such as the ring of fire around the Pacific.",
        "Volcanic soil is often very fertile, which is why people farm on the slopes despite the danger.",
    ]),
    "the moon": ("The Moon is Earth's only natural satellite and shapes the tides and the night sky.", [
        "It is about a quarter of the width of the Earth.",
        "The Moon takes about twenty-seven days to orbit the Earth.",
        "It also turns once on its own axis in the same time, so we always see the same side.",
        "The Moon does not make its own light; it reflects light from the Sun.",
        "As it travels around us, we see different amounts of its sunlit half, which we call phases.",
        "Its gravity pulls on the oceans and causes the tides.",
        "Astronauts first walked on the Moon in 1969.",
        "The dark patches that we can see are plains of old, cooled lava.",
    ]),
    "libraries": ("Libraries collect books and other resources and lend them to anyone who needs them.", [
        "Some of the earliest libraries held clay tablets rather than paper books.",
        "Public libraries that lend books for free became common in the nineteenth century.",
        "A library catalogue records every item and where it can be found on the shelves.",
        "Many libraries arrange non-fiction by subject using a numbering system, so that related books sit together.",
        "Today libraries also lend e-books, films and sometimes tools or musical instruments.",
        "They offer quiet places to study, internet access and help from trained librarians.",
        "Many run reading groups for children and classes for adults.",
    ]),
    "trains": ("Railways move people and goods efficiently along fixed tracks.", [
        "The first public railways used steam locomotives in the early nineteenth century.",
        "A steam engine burns coal to boil water, and the steam pushes pistons that turn the wheels.",
        "Railways made it possible to travel in hours journeys that once took days.",
        "Towns across the world changed their clocks to a shared time so that timetables would make sense.",
        "Most modern trains run on diesel engines or on electricity from overhead wires.",
        "High-speed trains can travel at more than three hundred kilometres per hour.",
        "Steel wheels on steel rails waste little energy, so trains use less fuel per passenger than cars.",
        "Freight trains carry heavy loads such as coal, grain and containers over long distances.",
    ]),
    "gardening": ("A productive vegetable garden depends on good soil, sunlight and regular care.", [
        "Most vegetables need at least six hours of direct sunlight a day.",
        "Adding compost to the soil feeds it and helps it hold water.",
        "Seeds should be sown at the depth shown on the packet, which is usually about twice their width.",
        "Watering deeply a few times a week is better than a light sprinkle every day, because it encourages deep "
        "roots.",
        "A layer of mulch keeps the soil moist and stops weeds from growing.",
        "Growing the same crop in the same place every year can build up pests, so gardeners rotate their beds.",
        "Picking beans and courgettes often makes the plants produce more.",
        "Keeping a simple notebook of what was planted and when makes next year's planning easier.",
    ]),
    "coffee": ("Coffee is brewed from the roasted seeds of the coffee plant.", [
        "Coffee plants grow best in warm, wet places near the equator.",
        "Their fruit are called cherries, and each contains two seeds, which we call beans.",
        "The beans are dried and then roasted, which creates most of the flavours we taste.",
        "Light roasts keep more fruity and acidic notes, while dark roasts taste more bitter and smoky.",
        "Grinding the beans just before brewing keeps the flavour fresh.",
        "Espresso forces hot water through finely ground coffee at high pressure.",
        "A filter machine lets hot water drip slowly through coarser grounds.",
        "Coffee contains caffeine, which makes many people feel more alert.",
    ]),
    "computer memory": ("Computers keep data in several kinds of memory that trade speed for size.", [
        "The processor has a few registers, which are tiny but extremely fast.",
        "Next come caches, small memories that hold recently used data close to the processor.",
        "Main memory, or RAM, is much larger but takes longer to reach.",
        "RAM forgets its contents when the power is turned off.",
        "Long-term storage such as solid-state drives keeps data without power but is slower still.",
        "Programs run faster when the data they need is already in a cache.",
        "This is why reading memory in order is quicker than jumping around at random.",
        "Designers balance cost, speed and size by stacking these layers into a hierarchy.",
    ]),
    "tides": ("Tides are the regular rise and fall of the sea caused mainly by the Moon's gravity.", [
        "The Moon pulls slightly harder on the side of the Earth facing it than on the far side.",
        "This difference stretches the oceans into two bulges, one towards the Moon and one away from it.",
        "As the Earth turns, most coasts pass through both bulges, giving two high tides a day.",
        "The Sun also affects the tides, but less strongly than the Moon.",
        "When the Sun and Moon line up, their pulls add together and produce extra high spring tides.",
        "When they are at right angles, the difference between high and low tide is smaller.",
        "The shape of the coast can make tides much larger, as in bays that narrow like a funnel.",
    ]),
    "maps": ("Maps show the shape of places on a flat surface using scale, symbols and direction.", [
        "The scale tells you how much a distance on the map stands for on the ground.",
        "Symbols in the legend stand for roads, rivers, forests and buildings.",
        "Contour lines join points at the same height, so closely packed lines mean a steep slope.",
        "Most maps put north at the top, shown by an arrow or a compass rose.",
        "Because the Earth is round, every flat map stretches or squeezes some areas.",
        "Grid lines and coordinates let you describe an exact position.",
        "Online maps combine satellite images with data about roads and traffic.",
    ]),
}

SUMMARY_INSTRUCTIONS = [
    "Summarize the following paragraph in one sentence.",
    "Give a one-sentence summary of this text.",
    "What is the main idea of the passage below?",
]

CONCISE_SYSTEMS = [
    "You are a concise assistant. Answer in as few words as possible.",
    "Keep answers short.",
]
HELPFUL_SYSTEMS = [
    "You are a friendly assistant who explains things clearly.",
    "You are a patient teacher. Explain your reasoning step by step.",
    "You are a helpful assistant.",
]

WORDS = [
    "garden", "river", "window", "planet", "pencil", "orange", "silver", "market", "candle", "forest",
    "button", "ladder", "rocket", "tunnel", "harbor", "meadow", "violin", "spider", "lantern", "bridge",
    "puzzle", "marble", "kettle", "island", "blanket", "compass", "thunder", "feather", "mirror", "saddle",
]
OPPOSITES = [
    ("hot", "cold"), ("early", "late"), ("empty", "full"), ("heavy", "light"), ("quiet", "loud"),
    ("rough", "smooth"), ("ancient", "modern"), ("narrow", "wide"), ("sharp", "blunt"), ("generous", "mean"),
    ("brave", "afraid"), ("shallow", "deep"), ("tight", "loose"), ("rare", "common"), ("arrive", "leave"),
]
PLURALS = [
    ("child", "children"), ("mouse", "mice"), ("knife", "knives"), ("city", "cities"), ("box", "boxes"),
    ("tooth", "teeth"), ("leaf", "leaves"), ("person", "people"), ("cactus", "cacti"), ("sheep", "sheep"),
    ("potato", "potatoes"), ("woman", "women"),
]

# (from unit, to unit, factor, noun for the explanation)
CONVERSIONS = [
    ("kilometres", "miles", 0.621371, "One kilometre is about 0.621 miles"),
    ("miles", "kilometres", 1.609344, "One mile is about 1.609 kilometres"),
    ("kilograms", "pounds", 2.204623, "One kilogram is about 2.205 pounds"),
    ("pounds", "kilograms", 0.453592, "One pound is about 0.454 kilograms"),
    ("litres", "US gallons", 0.264172, "One litre is about 0.264 US gallons"),
    ("metres", "feet", 3.280840, "One metre is about 3.281 feet"),
    ("inches", "centimetres", 2.54, "One inch is exactly 2.54 centimetres"),
    ("hours", "minutes", 60.0, "One hour has 60 minutes"),
]


def fmt_number(value: float) -> str:
    """Print whole numbers without decimals and others with two, so answers look hand-written."""
    return str(int(round(value))) if abs(value - round(value)) < 1e-9 else f"{value:.2f}"


def paragraph(rng: random.Random, topic: str, min_sentences: int = 2) -> str:
    """Take an in-order run of sentences from one topic, so the text reads naturally."""
    _, sentences = TOPICS[topic]
    count = rng.randint(min_sentences, len(sentences))
    start = rng.randint(0, len(sentences) - count)
    return " ".join(sentences[start : start + count])


def long_text(rng: random.Random) -> tuple[str, str]:
    """A paragraph that is sometimes two topics long, returned with the first topic's summary."""
    topic = rng.choice(sorted(TOPICS))
    text = TOPICS[topic][0] + " " + paragraph(rng, topic, min_sentences=3)
    if rng.random() < 0.35:
        other = rng.choice(sorted(set(TOPICS) - {topic}))
        text += "\n\n" + TOPICS[other][0] + " " + paragraph(rng, other, min_sentences=4)
    return text, TOPICS[topic][0]


# ---------------------------------------------------------------- single-turn tasks
# Each task returns (instruction, input, output); `input` is often empty.

def fact_task(rng: random.Random) -> tuple[str, str, str]:
    question, short, extra = rng.choice(FACTS)
    return question, "", short if rng.random() < 0.5 else f"{short} {extra}"


def arithmetic_task(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op, symbol, result = rng.choice([("add", "+", a + b), ("subtract", "-", a - b), ("multiply", "*", a * b)])
    style = rng.random()
    if style < 0.4:
        return f"What is {a} {symbol} {b}?", "", str(result)
    if style < 0.7:
        return f"Please {op} these two numbers.", f"{a}, {b}", f"{a} {symbol} {b} = {result}."
    steps = arithmetic_steps(a, b, symbol, result)
    return f"Work out {a} {symbol} {b} and explain each step.", "", steps


def arithmetic_steps(a: int, b: int, symbol: str, result: int) -> str:
    """A worked answer; longer than the bare result, which keeps the length mix realistic."""
    tens, ones = divmod(b, 10)
    if symbol == "+":
        return (f"Split {b} into {tens * 10} and {ones}. First, {a} + {tens * 10} = {a + tens * 10}. "
                f"Then {a + tens * 10} + {ones} = {result}. So {a} + {b} = {result}.")
    if symbol == "-":
        return (f"Split {b} into {tens * 10} and {ones}. First, {a} - {tens * 10} = {a - tens * 10}. "
                f"Then {a - tens * 10} - {ones} = {result}. So {a} - {b} = {result}.")
    return (f"Split {b} into {tens * 10} and {ones}. First, {a} * {tens * 10} = {a * tens * 10}. "
            f"Next, {a} * {ones} = {a * ones}. Adding the two parts gives {a * tens * 10} + {a * ones} = {result}. "
            f"So {a} * {b} = {result}.")


def sum_list_task(rng: random.Random) -> tuple[str, str, str]:
    numbers = [rng.randint(1, 60) for _ in range(rng.randint(3, 7))]
    return "Add up the following numbers.", ", ".join(map(str, numbers)), str(sum(numbers))


def conversion_task(rng: random.Random) -> tuple[str, str, str]:
    source, target, factor, explanation = rng.choice(CONVERSIONS)
    amount = rng.choice([1, 2, 3, 5, 8, 10, 12, 15, 20, 25, 42, 50, 100])
    result = fmt_number(amount * factor)
    question = f"Convert {amount} {source} to {target}."
    if rng.random() < 0.5:
        return question, "", f"{result} {target}."
    return question, "", f"{explanation}, so {amount} {source} is {amount} x {factor:g} = {result} {target}."


def temperature_task(rng: random.Random) -> tuple[str, str, str]:
    celsius = rng.choice([-10, 0, 5, 12, 20, 25, 30, 37, 40, 100])
    fahrenheit = fmt_number(celsius * 9 / 5 + 32)
    if rng.random() < 0.5:
        return f"What is {celsius} degrees Celsius in Fahrenheit?", "", f"{fahrenheit} degrees Fahrenheit."
    return (f"Convert {celsius} °C to Fahrenheit and show the formula.", "",
            f"Multiply by 9/5 and add 32: {celsius} x 9/5 + 32 = {fahrenheit}. So {celsius} °C is {fahrenheit} °F.")


def word_task(rng: random.Random) -> tuple[str, str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        word = rng.choice(WORDS)
        return "Reverse the letters of this word.", word, word[::-1]
    if kind == 1:
        words = rng.sample(WORDS, rng.randint(3, 8))
        return "Sort these words alphabetically.", ", ".join(words), ", ".join(sorted(words))
    if kind == 2:
        word, opposite = rng.choice(OPPOSITES)
        return f"What is the opposite of '{word}'?", "", opposite.capitalize() + "."
    if kind == 3:
        word, plural = rng.choice(PLURALS)
        return "Write the plural of the word.", word, plural
    if kind == 4:
        word = rng.choice(WORDS)
        vowels = sum(ch in "aeiou" for ch in word)
        return f"How many vowels are in the word '{word}'?", "", f"There are {vowels} vowels in '{word}'."
    word = rng.choice(WORDS)
    return "Write this word in capital letters.", word, word.upper()


def how_to_task(rng: random.Random) -> tuple[str, str, str]:
    question, steps = rng.choice(HOW_TO)
    if rng.random() < 0.3:
        return question, "", steps[0]
    if rng.random() < 0.5:
        return question, "", " ".join(steps)
    numbered = "\n".join(f"{i}. {step}" for i, step in enumerate(steps, 1))
    return question, "", f"Here is a simple method:\n{numbered}"


def summary_task(rng: random.Random) -> tuple[str, str, str]:
    text, summary = long_text(rng)
    return rng.choice(SUMMARY_INSTRUCTIONS), text, summary


TASKS = [
    (fact_task, 8), (arithmetic_task, 6), (sum_list_task, 2), (conversion_task, 5), (temperature_task, 2),
    (word_task, 8), (how_to_task, 6), (summary_task, 5),
]


def single_task(rng: random.Random) -> tuple[str, str, str]:
    """Pick a task kind by weight and build one (instruction, input, output)."""
    makers, weights = zip(*TASKS, strict=True)
    return rng.choices(makers, weights=weights)[0](rng)


def as_user_text(instruction: str, inp: str) -> str:
    return f"{instruction}\n{inp}" if inp else instruction


# ---------------------------------------------------------------- datasets

def alpaca_record(rng: random.Random) -> dict:
    """One alpaca record: mostly single-turn, some with a system prompt or a history of earlier turns."""
    roll = rng.random()
    if roll < 0.05:
        question = rng.choice(sorted(FOLLOW_UPS))
        short = next(f[1] for f in FACTS if f[0] == question)
        follow_q, follow_a = FOLLOW_UPS[question]
        record = {"instruction": follow_q, "input": "", "output": follow_a, "history": [[question, short]]}
    elif roll < 0.07:
        history = [list(pair[::2]) for pair in (single_task(rng) for _ in range(rng.randint(1, 2)))]
        instruction, inp, output = single_task(rng)
        record = {"instruction": instruction, "input": inp, "output": output, "history": history}
    else:
        instruction, inp, output = single_task(rng)
        record = {"instruction": instruction, "input": inp, "output": output}
    if rng.random() < 0.15:
        record["system"] = rng.choice(CONCISE_SYSTEMS + HELPFUL_SYSTEMS)
    return record


def chat_pairs(rng: random.Random) -> list[tuple[str, str]]:
    """Turns (user, assistant) for one conversation: a single task, a follow-up chain, or a mix."""
    roll = rng.random()
    if roll < 0.45:
        instruction, inp, output = single_task(rng)
        return [(as_user_text(instruction, inp), output)]
    if roll < 0.6:
        question = rng.choice(sorted(FOLLOW_UPS))
        fact = next(f for f in FACTS if f[0] == question)
        return [(question, f"{fact[1]} {fact[2]}"), FOLLOW_UPS[question]]
    if roll < 0.75:
        return arithmetic_chain(rng)
    if roll < 0.85:
        question, steps = rng.choice(HOW_TO)
        return [(question, " ".join(steps)), ("Can you make that shorter?", steps[0]), ("Thanks!", "You're welcome.")]
    tasks = [single_task(rng) for _ in range(rng.randint(2, 4))]
    return [(as_user_text(instruction, inp), output) for instruction, inp, output in tasks]


def arithmetic_chain(rng: random.Random) -> list[tuple[str, str]]:
    """A running calculation across turns, so later answers depend on earlier ones."""
    value = rng.randint(2, 30)
    turns = [(f"Start with {value}. Add {(step := rng.randint(2, 20))}.", f"{value} + {step} = {value + step}.")]
    value += step
    for _ in range(rng.randint(1, 3)):
        factor = rng.randint(2, 5)
        turns.append((f"Now multiply that by {factor}.", f"{value} * {factor} = {value * factor}."))
        value *= factor
    return turns


def sharegpt_record(rng: random.Random) -> dict:
    conversation = []
    if rng.random() < 0.25:
        conversation.append({"from": "system", "value": rng.choice(CONCISE_SYSTEMS + HELPFUL_SYSTEMS)})
    for user, assistant in chat_pairs(rng):
        conversation += [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]
    return {"conversations": conversation}


def pt_record(rng: random.Random) -> dict:
    if rng.random() < 0.4:
        return {"text": long_text(rng)[0]}
    topic = rng.choice(sorted(TOPICS))
    return {"text": paragraph(rng, topic)}


DATASET_INFO = {
    "demo": {"file_name": "demo_alpaca.json", "formatting": "alpaca"},
    "demo_sharegpt": {
        "file_name": "demo_sharegpt.jsonl",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations"},
        "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                 "assistant_tag": "gpt", "system_tag": "system"},
    },
    "demo_pt": {"file_name": "demo_pt.jsonl", "formatting": "alpaca", "columns": {"prompt": "text"}},
    "demo_dpo": {"file_name": "demo_dpo.json", "formatting": "alpaca", "ranking": True,
                 "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected",
                             "history": "history"}},
    "demo_dpo_sharegpt": {"file_name": "demo_dpo_sharegpt.jsonl", "formatting": "sharegpt", "ranking": True,
                          "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
    "demo_kto": {"file_name": "demo_kto.json", "formatting": "alpaca",
                 "columns": {"prompt": "instruction", "query": "input", "response": "output", "kto_tag": "kto_tag"}},
    "demo_images": {"file_name": "demo_images.json", "formatting": "sharegpt",
                    "columns": {"messages": "messages", "images": "images"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant"}},
    # stage grpo's prompts (examples/grpo/): written by hand, not by this script
    "demo_grpo": {"file_name": "demo_grpo.json", "formatting": "alpaca"},
}
# demo_images: a shape in a colour on white, each picture asked about twice (what it shows, its colour).
PICTURES = {"red_square": ((220, 30, 30), "square"), "blue_circle": ((30, 60, 220), "circle"),
            "green_triangle": ((30, 160, 60), "triangle"), "yellow_square": ((230, 200, 20), "square")}
REFUSALS = ("I will not help with that.", "No.", "Ask someone else.", "That question is not worth answering.")


def preference_record(rng: random.Random, index: int) -> dict:
    """A prompt with a helpful chosen answer and a curt refusal as the rejected one: learnably different, so a
    preference run's reward accuracy rises above chance within a few steps; every eighth has a history turn."""
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    if index % 3 == 0:
        question, chosen = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    elif index % 3 == 1:
        fruit = rng.choice(("apple", "pear", "plum", "cherry", "grape", "lemon", "melon", "peach"))
        colour = rng.choice(("red", "blue", "green", "yellow", "purple", "orange"))
        question = f"Name the colour of a ripe {fruit}."
        chosen = f"A ripe {fruit} is usually {colour}; the exact shade depends on the variety."
    else:
        question, chosen = f"Count from {a} to {a + 3}.", ", ".join(str(x) for x in range(a, a + 4)) + "."
    record = {"instruction": question, "input": "", "chosen": chosen, "rejected": rng.choice(REFUSALS)}
    if index % 8 == 5:
        record["history"] = [["Hello, can you help me?", "Of course, ask your question."]]
    return record


def preference_sharegpt(record: dict) -> dict:
    """The same pair in ShareGPT style: the conversation ends with the prompt; chosen/rejected are answer turns."""
    turns = []
    for question, answer in record.get("history", []):
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    turns.append({"from": "human", "value": record["instruction"]})
    return {"conversations": turns, "chosen": {"from": "gpt", "value": record["chosen"]},
            "rejected": {"from": "gpt", "value": record["rejected"]}}


def write_preference_data(out_dir: Path, seed: int) -> None:
    """demo_dpo (alpaca pairs), demo_dpo_sharegpt and demo_kto (one answer per record with its kto_tag)."""
    rng = random.Random(seed + 1)  # its own stream: the other demo files stay as they were
    pairs = [preference_record(rng, i) for i in range(48)]
    (out_dir / "demo_dpo.json").write_text(json.dumps(pairs, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    write_jsonl(out_dir / "demo_dpo_sharegpt.jsonl", [preference_sharegpt(r) for r in pairs[:16]])
    kto = [{"instruction": r["instruction"], "input": "", "output": r["chosen"] if i % 2 == 0 else r["rejected"],
            "kto_tag": i % 2 == 0} for i, r in enumerate(pairs[:32])]
    (out_dir / "demo_kto.json").write_text(json.dumps(kto, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def write_image_data(out_dir: Path) -> None:
    """demo_images.json and its pictures (64 x 48 PNGs under demo_images/)."""
    from PIL import Image, ImageDraw

    (out_dir / "demo_images").mkdir(exist_ok=True)
    records = []
    for name, (colour, shape) in PICTURES.items():
        image = Image.new("RGB", (64, 48), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        if shape == "square":
            draw.rectangle((16, 8, 48, 40), fill=colour)
        elif shape == "circle":
            draw.ellipse((16, 8, 48, 40), fill=colour)
        else:
            draw.polygon([(32, 8), (16, 40), (48, 40)], fill=colour)
        image.save(out_dir / "demo_images" / f"{name}.png")
        word, path = name.split("_")[0], f"demo_images/{name}.png"
        records += [{"messages": [{"role": "user", "content": "<image>What is in the picture?"},
                                  {"role": "assistant", "content": f"A {word} {shape} on a white background."}],
                     "images": [path]},
                    {"messages": [{"role": "user", "content": f"<image>What colour is the {shape}?"},
                                  {"role": "assistant", "content": f"It is {word}."}], "images": [path]}]
    (out_dir / "demo_images.json").write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def write_demo_data(out_dir: Path, seed: int = SEED) -> None:
    """Write the demo datasets (sft, pt, preference) and dataset_info.json into ``out_dir``."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    alpaca = [alpaca_record(rng) for _ in range(300)]
    (out_dir / "demo_alpaca.json").write_text(json.dumps(alpaca, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    write_jsonl(out_dir / "demo_sharegpt.jsonl", [sharegpt_record(rng) for _ in range(200)])
    write_jsonl(out_dir / "demo_pt.jsonl", [pt_record(rng) for _ in range(200)])
    write_preference_data(out_dir, seed)
    write_image_data(out_dir)
    (out_dir / "dataset_info.json").write_text(json.dumps(DATASET_INFO, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    write_demo_data(args.out, args.seed)
    print(f"wrote demo data to {args.out}")


if __name__ == "__main__":
    main()
