"""The embedded WebShop catalog: product types, a seeded product generator and WebShop-style goals.

Products and goals are plain dicts with WebShop's own field names (`asin`, `name`, `Title`, `BulletPoints`,
`Description`, `Attributes`, `product_category`, `query`, `options`, `pricing`, `Price`, `Rating`, `Reviews`)
plus `name_nouns`, the nouns of the title, recorded when the title is written (WebShop tags them with spaCy).
Everything is drawn from `random.Random` seeded by strings, so the same preset and seed give the same shop on
every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rapidfuzz import fuzz, utils

# WebShop's colour list (web_agent_site/engine/normalize.py), in its order: an option value is normalised to
# the first of these it contains as a substring.
COLOR_SET = (
    "alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown burgundy camel "
    "camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac copper coral cranberry "
    "cream crystal dark denim eggplant elephant espresso fuchsia gold granite grape graphite grass gray green grey "
    "heather indigo ivory ivy khaki lavender lemon leopard light lilac lime magenta maroon mauve merlot midnight "
    "mint mocha multicolor mushroom mustard natural navy nude olive orange peach pewter pink plum purple rainbow "
    "red rose royal rust sand sapphire seashell silver skull slate steel stone stonewash sunflower tan taupe teal "
    "tiger turquoise violet walnut wheat white wine yellow"
).split()

# WebShop's price grid: price_upper is drawn from the multiples of 10 above the product's price.
PRICE_RANGE = tuple(10.0 * i for i in range(1, 100))


def normalize_color(value: str) -> str:
    """The first colour of COLOR_SET contained in `value` (substring test), else `value` unchanged."""
    for color in COLOR_SET:
        if color in value:
            return color
    return value


def fuzzy_ratio(a: str, b: str) -> float:
    """thefuzz's token_set_ratio (0-100): lowercases, strips punctuation, compares token sets."""
    return fuzz.token_set_ratio(a, b, processor=utils.default_process)


# ----------------------------------------------------------------------------------------------- product types
# Each type: (category, query, type name, nouns of the type name, category path below the top level,
#             attribute pool, option groups, price range, title suffix options (text, nouns), use phrase)
# The attribute pools are chosen so that no attribute fuzzy-matches or is a substring of another of the same
# type, so a product lacking an attribute never earns it (tests check this on the whole catalog).
_ROOTS = {
    "beauty": "Beauty & Personal Care",
    "food": "Grocery & Gourmet Food",
    "fashion": "Clothing, Shoes & Jewelry",
    "furniture": "Home & Kitchen",
    "electronics": "Electronics",
}

_SIZES_CLOTHES = ["small", "medium", "large", "x-large", "xx-small"]


@dataclass(frozen=True)
class ProductType:
    category: str
    query: str
    name: str
    nouns: tuple[str, ...]
    path: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    price: tuple[float, float]
    suffixes: tuple[tuple[str, tuple[str, ...]], ...]
    use: str


def _t(category, query, name, nouns, path, attributes, options, price, suffixes=(), use="everyday use"):
    return ProductType(
        category,
        query,
        name,
        tuple(nouns.split()),
        f"{_ROOTS[category]} › {path}",
        tuple(attributes),
        tuple((k, tuple(v)) for k, v in options.items()),
        price,
        tuple((s, tuple(n.split())) for s, n in suffixes),
        use,
    )


# The first two types of every category form the `small` preset's shop.
PRODUCT_TYPES: tuple[ProductType, ...] = (
    # beauty
    _t("beauty", "hair extensions", "hair extension", "hair extension",
       "Hair Care › Hair Extensions, Wigs & Accessories › Extensions",
       ["natural looking", "heat resistant", "tangle free", "clip in", "double weft", "human hair"],
       {"color": ["black", "dark brown", "blonde", "auburn", "platinum", "burgundy"],
        "size": ["14 inch", "20 inch", "36 inch"]},
       (15, 80), [("for women", "women")], "daily styling"),
    _t("beauty", "lipstick", "lipstick", "lipstick", "Makeup › Lips › Lipstick",
       ["long lasting", "matte finish", "cruelty free", "vitamin e", "moisturizing formula"],
       {"color": ["red", "pink", "nude", "coral", "plum", "berry", "mauve"]},
       (5, 30), [], "a bold look"),
    _t("beauty", "shampoo", "shampoo", "shampoo", "Hair Care › Shampoo & Conditioner › Shampoos",
       ["sulfate free", "color safe", "paraben free", "argan oil", "dandruff control", "volumizing"],
       {"scent": ["lavender", "coconut", "mint", "citrus", "unscented"], "size": ["8 ounce", "16 ounce", "32 ounce"]},
       (6, 40), [("for dry hair", "hair")], "clean and soft hair"),
    _t("beauty", "face moisturizer", "face moisturizer", "face moisturizer",
       "Skin Care › Face › Creams & Moisturizers",
       ["oil free", "fragrance free", "hyaluronic acid", "sensitive skin", "anti aging", "spf 30"],
       {"size": ["1.7 ounce", "3.4 ounce", "6 ounce"]},
       (8, 60), [], "a smooth complexion"),
    _t("beauty", "nail polish", "nail polish", "nail polish", "Foot, Hand & Nail Care › Nail Art & Polish › Nail Polish",
       ["quick dry", "chip resistant", "non toxic", "high shine", "vegan"],
       {"color": ["red", "pink", "black", "teal", "gold", "lilac", "white"], "size": ["0.5 ounce", "2 pack"]},
       (4, 25), [], "salon nails at home"),
    # food
    _t("food", "protein bars", "protein bar", "protein bar", "Snack Foods › Bars › Protein Bars",
       ["gluten free", "low sugar", "plant based", "non gmo", "keto friendly", "high fiber"],
       {"flavor name": ["chocolate chip", "peanut butter", "vanilla almond", "cookie dough", "lemon"],
        "size": ["12 count", "30 count"]},
       (10, 45), [], "a quick snack"),
    _t("food", "ground coffee", "ground coffee", "coffee", "Beverages › Coffee, Tea & Cocoa › Coffee › Ground Coffee",
       ["medium roast", "fair trade", "single origin", "low acid", "usda organic"],
       {"flavor name": ["hazelnut", "french vanilla", "original", "caramel", "mocha"],
        "size": ["12 ounce", "2 pound"]},
       (7, 35), [], "a fresh morning cup"),
    _t("food", "herbal tea", "herbal tea", "tea", "Beverages › Coffee, Tea & Cocoa › Tea › Herbal",
       ["caffeine free", "usda organic", "kosher certified", "individually wrapped", "loose leaf"],
       {"flavor name": ["chamomile", "peppermint", "ginger", "hibiscus", "rooibos"], "size": ["20 count", "100 count"]},
       (4, 25), [], "a calm evening"),
    _t("food", "olive oil", "olive oil", "olive oil", "Pantry Staples › Cooking Oils › Olive Oil",
       ["extra virgin", "cold pressed", "non gmo", "glass bottle", "first harvest"],
       {"size": ["16.9 fl oz", "34 fl oz", "1 gallon"]},
       (8, 50), [], "cooking and salads"),
    _t("food", "beef jerky", "beef jerky", "beef jerky", "Snack Foods › Jerky & Dried Meats › Beef Jerky",
       ["high protein", "gluten free", "low sodium", "grass fed", "no preservatives"],
       {"flavor name": ["original", "teriyaki", "peppered", "sweet and spicy"], "size": ["3 ounce", "10 ounce"]},
       (6, 40), [], "hiking and road trips"),
    # fashion
    _t("fashion", "men t shirts", "t-shirt", "shirt", "Men › Clothing › Shirts › T-Shirts",
       ["machine wash", "short sleeve", "crew neck", "classic fit", "moisture wicking", "cotton blend"],
       {"color": ["black", "white", "navy blue", "heather grey", "red", "olive green"], "size": _SIZES_CLOTHES},
       (9, 35), [("for men", "men")], "casual wear"),
    _t("fashion", "women running shoes", "running shoe", "shoe", "Women › Shoes › Athletic › Running",
       ["non slip", "lightweight", "breathable mesh", "arch support", "rubber sole", "memory foam"],
       {"color": ["black", "white", "pink", "gray", "purple", "blue"], "size": ["6", "7", "8", "9", "10"]},
       (25, 120), [("for women", "women")], "running and walking"),
    _t("fashion", "women dresses", "maxi dress", "dress", "Women › Clothing › Dresses › Casual",
       ["hand wash", "long sleeve", "v neck", "floral print", "high waist", "button closure"],
       {"color": ["black", "red", "green", "yellow", "blue"], "size": _SIZES_CLOTHES},
       (20, 70), [("for women", "women")], "summer parties"),
    _t("fashion", "backpack", "backpack", "backpack", "Luggage & Travel Gear › Backpacks › Casual Daypacks",
       ["water resistant", "laptop compartment", "usb charging port", "padded straps", "anti theft"],
       {"color": ["black", "gray", "navy", "khaki", "red"]},
       (20, 90), [], "school and travel"),
    _t("fashion", "polarized sunglasses", "sunglasses", "sunglasses",
       "Men › Accessories › Sunglasses & Eyewear Accessories › Sunglasses",
       ["polarized lens", "uv protection", "metal frame", "scratch resistant", "lightweight"],
       {"color": ["black", "gold", "silver", "tortoise"]},
       (12, 60), [("for men", "men")], "sunny days"),
    # furniture
    _t("furniture", "office chair", "office chair", "office chair",
       "Furniture › Home Office Furniture › Home Office Chairs › Desk Chairs",
       ["lumbar support", "height adjustable", "easy assembly", "breathable mesh", "swivel wheels"],
       {"color": ["black", "gray", "white", "blue"]},
       (60, 250), [], "long work days"),
    _t("furniture", "bookcase", "bookshelf", "bookshelf", "Furniture › Living Room Furniture › Bookcases",
       ["solid wood", "easy assembly", "wall anchor", "open shelves", "space saving"],
       {"color": ["white", "espresso", "walnut", "black", "oak"], "size": ["3 tier", "5 tier"]},
       (40, 200), [], "books and decor"),
    _t("furniture", "bed sheets", "bed sheet set", "bed sheet set",
       "Bedding › Sheets & Pillowcases › Sheet & Pillowcase Sets",
       ["deep pocket", "wrinkle free", "machine washable", "egyptian cotton", "cooling fabric"],
       {"color": ["white", "gray", "beige", "sage", "navy"], "size": ["twin", "full", "queen", "king"]},
       (20, 90), [], "a restful sleep"),
    _t("furniture", "coffee table", "coffee table", "coffee table",
       "Furniture › Living Room Furniture › Tables › Coffee Tables",
       ["storage shelf", "tempered glass", "easy assembly", "solid wood", "round top"],
       {"color": ["black", "walnut", "white", "rustic brown"]},
       (50, 260), [("for living room", "living room")], "the living room"),
    _t("furniture", "throw pillow covers", "throw pillow cover", "throw pillow cover",
       "Home Décor › Decorative Pillows, Inserts & Covers › Throw Pillow Covers",
       ["hidden zipper", "soft velvet", "machine washable", "double sided", "set of 2"],
       {"color": ["blue", "mustard", "gray", "pink", "green"], "size": ["18 x 18 inch", "20 x 20 inch"]},
       (8, 30), [], "the sofa and bed"),
    # electronics
    _t("electronics", "wireless earbuds", "wireless earbuds", "earbuds",
       "Headphones, Earbuds & Accessories › Headphones & Earbuds › Earbud Headphones",
       ["noise cancelling", "water resistant", "charging case", "touch control", "built in microphone"],
       {"color": ["black", "white", "blue", "rose gold"]},
       (20, 150), [], "music and calls"),
    _t("electronics", "phone case", "phone case", "phone case",
       "Cell Phones & Accessories › Cases, Holsters & Sleeves › Basic Cases",
       ["shockproof", "slim fit", "wireless charging compatible", "raised edges", "kickstand"],
       {"color": ["black", "clear", "pink", "green", "purple"],
        "style": ["iphone 13", "iphone 14 pro", "galaxy s22"]},
       (6, 30), [], "daily protection"),
    _t("electronics", "usb c cable", "usb c cable", "cable",
       "Computers & Accessories › Computer Accessories & Peripherals › Cables & Accessories › USB Cables",
       ["fast charging", "braided nylon", "data transfer", "tangle free", "aluminum connector"],
       {"color": ["black", "white", "red"], "size": ["3 feet", "6 feet", "10 feet"]},
       (5, 25), [], "phones and laptops"),
    _t("electronics", "bluetooth speaker", "bluetooth speaker", "speaker",
       "Portable Audio & Video › Portable Speakers & Docks › Portable Bluetooth Speakers",
       ["waterproof", "deep bass", "long battery life", "dual pairing", "built in microphone"],
       {"color": ["black", "blue", "red", "camo"]},
       (20, 130), [("for outdoor", "outdoor")], "parties and trips"),
    _t("electronics", "wireless mouse", "wireless mouse", "mouse",
       "Computers & Accessories › Computer Accessories & Peripherals › Keyboards, Mice & Accessories › Mice",
       ["ergonomic design", "silent click", "rechargeable battery", "adjustable dpi", "usb receiver"],
       {"color": ["black", "white", "gray", "pink"]},
       (8, 45), [], "work and gaming"),
)  # fmt: skip

_BRANDS = {
    "beauty": ["Lumera", "Velvia", "Rosetta", "Aurelle", "Kindra", "Belmora", "Solenne", "Marisol"],
    "food": ["Harvest Lane", "Kettleby", "Orchard Hill", "Greenfold", "Sunmill", "Bramble", "Copperpot", "Wildroot"],
    "fashion": ["Northpeak", "Urbano", "Fieldstone", "Marlow", "Tessa", "Driftwood", "Kestrel", "Ravello"],
    "furniture": ["Oakhaven", "Linwood", "Casafina", "Homeward", "Birchly", "Stellan", "Nordvik", "Ashby"],
    "electronics": ["Voltrix", "Sonique", "Zentek", "Auralink", "Pixelon", "Nexora", "Cordwell", "Lumatron"],
}

_FEATURE_LINES = {
    "beauty": ["Gentle on every skin and hair type", "Dermatologist tested formula", "Travel friendly packaging"],
    "food": ["Packed fresh for great taste", "Resealable package keeps it fresh", "Made in a certified facility"],
    "fashion": ["Comfortable fit for all day wear", "Durable stitching", "Easy care fabric"],
    "furniture": ["Sturdy frame for years of use", "Modern design fits any room", "All hardware included"],
    "electronics": ["One year warranty", "Simple setup in minutes", "Compatible with most devices"],
}

_REVIEW_TITLES = ["Great value", "Works as described", "Not bad", "Love it", "Would buy again"]
_REVIEW_BODIES = ["Exactly what I needed.", "Good quality for the price.", "Arrived quickly and works well."]


@dataclass(frozen=True)
class Preset:
    """Catalog size and text lengths; `default` is close to WebShop's 1k-product setting."""

    types_per_category: int
    products_per_type: int
    attrs_per_product: tuple[int, int]
    goal_attrs: tuple[int, int]
    max_option_groups: int
    values_per_option: tuple[int, int]
    bullets: int
    max_reviews: int
    title_case: bool
    title_suffix: float  # probability of an audience suffix such as "for women"
    templates: tuple[str, ...]


_TEMPLATES_LONG = (
    "i need {a} {type} that is {attrs}{opts}",
    "i am looking for {a} {attrs} {type}{opts}",
    "i want to buy {a} {type} which is {attrs}{opts}",
    "find me {a} {type} that is {attrs}{opts}",
    "i'm looking for {a} {type} with {attrs}{opts}",
)
_TEMPLATES_SHORT = ("i need {a} {type} that is {attrs}{opts}", "i want {a} {attrs} {type}{opts}")

PRESETS = {
    "default": Preset(5, 40, (3, 4), (1, 3), 2, (2, 4), 4, 2, True, 0.6, _TEMPLATES_LONG),
    "small": Preset(2, 20, (2, 3), (1, 2), 2, (2, 3), 2, 1, False, 0.0, _TEMPLATES_SHORT),
}

_OPTION_PHRASES = {
    "color": "in {v} color",
    "size": "in size {v}",
    "flavor name": "in {v} flavor",
    "scent": "with {v} scent",
    "style": "for {v}",
}


def _asin(rng: random.Random) -> str:
    return "B0" + "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", k=8))


def _distinct(value: str, chosen: list[str]) -> bool:
    """True when `value` cannot be mistaken for any of `chosen` by WebShop's option matching."""
    v = normalize_color(value)
    return all(v != normalize_color(c) and fuzzy_ratio(v, normalize_color(c)) <= 85 for c in chosen)


def _title(brand: str, words: list[str], title_case: bool) -> str:
    text = " ".join([brand, *words])
    if not title_case:
        return text.lower()
    return " ".join(w if w.isupper() or w[0].isdigit() else w[:1].upper() + w[1:] for w in text.split())


def preset_types(preset: str) -> list[ProductType]:
    p = PRESETS[preset]
    by_cat: dict[str, list[ProductType]] = {}
    for t in PRODUCT_TYPES:
        by_cat.setdefault(t.category, []).append(t)
    return [t for cat in _ROOTS for t in by_cat[cat][: p.types_per_category]]


def generate_catalog(preset: str = "small", seed: int = 0) -> list[dict]:
    """The shop's products (WebShop field names), deterministic in (preset, seed)."""
    p = PRESETS[preset]
    rng = random.Random(f"rspo-webshop/{preset}/{seed}/catalog")
    products: list[dict] = []
    asins: set[str] = set()
    for ptype in preset_types(preset):
        brands = _BRANDS[ptype.category]
        for _ in range(p.products_per_type):
            asin = _asin(rng)
            while asin in asins:
                asin = _asin(rng)
            asins.add(asin)
            brand = rng.choice(brands)
            attrs = rng.sample(ptype.attributes, rng.randint(*p.attrs_per_product))
            # Options: up to max_option_groups groups, each with values no option matcher can confuse.
            options: dict[str, list[str]] = {}
            taken: list[str] = []
            for name, pool in ptype.options[: p.max_option_groups]:
                want = rng.randint(*p.values_per_option)
                values = []
                for v in rng.sample(pool, len(pool)):
                    if len(values) < want and _distinct(v, taken):
                        values.append(v)
                        taken.append(v)
                options[name] = values
            words, nouns = [], [*brand.lower().split(), *ptype.nouns]
            if rng.random() < 0.5:
                words.append(attrs[0])
            words.append(ptype.name)
            if ptype.suffixes and rng.random() < p.title_suffix:
                text, suffix_nouns = rng.choice(ptype.suffixes)
                words.append(text)
                nouns.extend(suffix_nouns)
            title = _title(brand, words, p.title_case)
            price = round(rng.uniform(*ptype.price), 0) - 0.01
            bullets = [f"{a.capitalize()} {ptype.name}" for a in attrs]
            bullets += rng.sample(_FEATURE_LINES[ptype.category], max(0, p.bullets - len(bullets)))
            description = f"This {ptype.name} from {brand} is made for {ptype.use}."
            reviews = [
                {"title": rng.choice(_REVIEW_TITLES), "score": rng.randint(3, 5), "body": rng.choice(_REVIEW_BODIES)}
                for _ in range(rng.randint(0, p.max_reviews))
            ]
            rating = f"{sum(r['score'] for r in reviews) / len(reviews):.1f}" if reviews else "N.A."
            products.append(
                {
                    "asin": asin,
                    "category": ptype.category,
                    "query": ptype.query,
                    "name": title,
                    "Title": title,
                    "name_nouns": nouns,
                    "product_category": ptype.path,
                    "BulletPoints": bullets,
                    "Description": description,
                    "Attributes": list(attrs),
                    "options": options,
                    "pricing": [price],
                    "Price": f"${price:.2f}",
                    "Rating": rating,
                    "Reviews": reviews,
                    "type_name": ptype.name,
                    "attribute_pool": list(ptype.attributes),
                }
            )
    return products


def price_upper_for(price: float, rng: random.Random) -> tuple[float, str]:
    """WebShop's rule: of the first four multiples of 10 above `price`, sample two and keep the larger."""
    candidates = [p for p in PRICE_RANGE if p > price][:4]
    if len(candidates) < 2:
        return 1e6, ""
    upper = max(rng.sample(candidates, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


def _join(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def make_goal_candidate(product: dict, preset: str, rng: random.Random) -> dict:
    """One WebShop-style goal for `product`: some of its attributes, one value of some option groups, a price cap."""
    p = PRESETS[preset]
    lo, hi = p.goal_attrs
    attributes = rng.sample(product["Attributes"], rng.randint(lo, min(hi, len(product["Attributes"]))))
    groups = [k for k, v in product["options"].items() if v]
    groups = rng.sample(groups, rng.randint(min(1, len(groups)), len(groups)))
    groups.sort(key=list(product["options"]).index)
    goal_options = {k: rng.choice(product["options"][k]) for k in groups}
    price_upper, price_text = price_upper_for(product["pricing"][0], rng)
    type_name = product["type_name"]
    opts = " and ".join(_OPTION_PHRASES[k].format(v=v) for k, v in goal_options.items())
    template = rng.choice(p.templates)
    article = "an" if type_name[0] in "aeio" else "a"
    if type_name.endswith("s") and not type_name.endswith("ss"):
        article = "some"
    text = template.format(a=article, type=type_name, attrs=_join(attributes), opts=(", " + opts) if opts else "")
    return {
        "asin": product["asin"],
        "category": product["category"],
        "query": product["query"],
        "name": product["name"],
        "name_nouns": list(product["name_nouns"]),
        "product_category": product["product_category"],
        "instruction_text": text + price_text,
        "search_text": text,
        "attributes": attributes,
        "goal_options": list(goal_options.values()),
        "goal_option_groups": goal_options,
        "price_upper": price_upper,
    }
