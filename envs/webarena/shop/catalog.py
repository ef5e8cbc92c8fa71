"""The shop's data, generated deterministically: catalog, reviews, customers, orders.

Runs inside the image build (Debian's python3, standard library only)::

    python3 catalog.py /var/lib/shop/shop.db

The same seed always gives the same database, so shipped tasks can name products,
prices, reviewers and orders. The catalog has 12 categories, 48 subcategories and
about 2,200 products; products have 0-14 reviews each.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import sqlite3

SEED = 20240607
DEFAULT_EMAIL = "emma.lopez@example.com"
DEFAULT_PASSWORD = "Password.123"
PER_SUBCATEGORY = 46
#: the stored signed-in session of the benchmark account (WebArena's ``.auth/shopping_state.json``)
AUTH_TOKEN = "5a1e0b2c7d9f4e3a8b6c1d0e2f4a6b8c"

SCHEMA = """
CREATE TABLE categories (id INTEGER PRIMARY KEY, parent_id INTEGER, name TEXT NOT NULL, slug TEXT NOT NULL UNIQUE,
  path TEXT NOT NULL UNIQUE);
CREATE TABLE products (id INTEGER PRIMARY KEY, sku TEXT NOT NULL UNIQUE, name TEXT NOT NULL, slug TEXT NOT NULL UNIQUE,
  category_id INTEGER NOT NULL REFERENCES categories(id), brand TEXT NOT NULL, color TEXT, price_cents INTEGER NOT NULL,
  description TEXT NOT NULL, stock INTEGER NOT NULL, created TEXT NOT NULL);
CREATE INDEX products_category ON products(category_id);
CREATE TABLE reviews (id INTEGER PRIMARY KEY, product_id INTEGER NOT NULL REFERENCES products(id),
  customer_id INTEGER, nickname TEXT NOT NULL, rating INTEGER NOT NULL, title TEXT NOT NULL, body TEXT NOT NULL,
  created TEXT NOT NULL);
CREATE INDEX reviews_product ON reviews(product_id);
CREATE TABLE customers (id INTEGER PRIMARY KEY, email TEXT NOT NULL UNIQUE, password_hash TEXT NOT NULL,
  first_name TEXT NOT NULL, last_name TEXT NOT NULL, phone TEXT NOT NULL, street TEXT NOT NULL, city TEXT NOT NULL,
  region TEXT NOT NULL, postcode TEXT NOT NULL, country TEXT NOT NULL, newsletter INTEGER NOT NULL DEFAULT 0,
  created TEXT NOT NULL);
CREATE TABLE sessions (token TEXT PRIMARY KEY, customer_id INTEGER, created TEXT NOT NULL);
CREATE TABLE cart_items (id INTEGER PRIMARY KEY, owner TEXT NOT NULL, product_id INTEGER NOT NULL, qty INTEGER NOT NULL,
  UNIQUE(owner, product_id));
CREATE TABLE wishlist_items (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL, product_id INTEGER NOT NULL,
  added TEXT NOT NULL, UNIQUE(customer_id, product_id));
CREATE TABLE orders (id INTEGER PRIMARY KEY, number TEXT NOT NULL UNIQUE, customer_id INTEGER NOT NULL,
  created TEXT NOT NULL, status TEXT NOT NULL, ship_name TEXT NOT NULL, ship_street TEXT NOT NULL,
  ship_city TEXT NOT NULL, ship_region TEXT NOT NULL, ship_postcode TEXT NOT NULL, ship_country TEXT NOT NULL,
  shipping_method TEXT NOT NULL, shipping_cents INTEGER NOT NULL, payment_method TEXT NOT NULL,
  subtotal_cents INTEGER NOT NULL, total_cents INTEGER NOT NULL);
CREATE TABLE order_items (id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL REFERENCES orders(id),
  product_id INTEGER NOT NULL, name TEXT NOT NULL, sku TEXT NOT NULL, price_cents INTEGER NOT NULL,
  qty INTEGER NOT NULL);
CREATE TABLE contact_messages (id INTEGER PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL, phone TEXT,
  comment TEXT NOT NULL, created TEXT NOT NULL);
"""

# category -> subcategory -> (product nouns, price range in dollars, topic remarks for reviews)
CATALOG: dict[str, dict[str, tuple[list[str], tuple[int, int], list[str]]]] = {
    "Electronics": {
        "Headphones": (["Wireless Over-Ear Headphones", "Noise Cancelling Headphones", "In-Ear Earbuds",
                        "Bluetooth Sports Earphones", "Studio Monitor Headphones", "Kids Headphones"], (12, 260),
                       ["The ear cups are too small for my ears.", "Battery life easily lasts a whole week.",
                        "The bass is deep without being muddy.", "Bluetooth pairing was instant.",
                        "The headband started to crack after a month."]),
        "Speakers": (["Portable Bluetooth Speaker", "Smart Speaker", "Bookshelf Speakers", "Soundbar",
                      "Waterproof Shower Speaker"], (15, 400),
                     ["It is loud enough for a backyard party.", "The sound distorts at full volume.",
                      "Survived a drop into the pool.", "Setup through the app was confusing."]),
        "Computer Accessories": (["Wireless Mouse", "Mechanical Keyboard", "USB-C Hub", "Laptop Stand",
                                  "Webcam 1080p", "Mouse Pad XXL"], (8, 180),
                                 ["Works with my Mac out of the box.", "The keys are a bit loud for an office.",
                                  "The cable is too short.", "Stopped working after two weeks."]),
        "Chargers & Cables": (["USB-C Fast Charger", "Lightning Cable 6ft", "Wireless Charging Pad",
                               "Power Bank 20000mAh", "Car Charger Dual Port"], (6, 70),
                              ["Charges my phone in under an hour.", "Gets very hot while charging.",
                               "The braided cable feels durable.", "Did not fit my phone case."]),
    },
    "Cell Phones & Accessories": {
        "Cases": (["Shockproof Phone Case", "Clear Slim Case", "Leather Wallet Case", "Rugged Armor Case"], (7, 45),
                  ["Fits my phone perfectly.", "The buttons are hard to press.", "Yellowed after a few weeks.",
                   "Saved my phone from a nasty fall."]),
        "Screen Protectors": (["Tempered Glass Screen Protector", "Privacy Screen Protector",
                               "Matte Screen Protector"], (5, 25),
                              ["Installation was bubble free.", "It cracked after three days of use.",
                               "Touch sensitivity is unchanged.", "The alignment frame helps a lot."]),
        "Mounts & Stands": (["Magnetic Car Mount", "Adjustable Phone Stand", "Bike Phone Holder",
                             "Selfie Stick Tripod"], (9, 60),
                            ["Holds the phone steady on bumpy roads.", "The magnet is weaker than expected.",
                             "Great for video calls.", "The clamp broke quickly."]),
        "Smartwatch Bands": (["Silicone Watch Band", "Stainless Steel Watch Band", "Nylon Sport Loop"], (6, 40),
                             ["Comfortable for all-day wear.", "The clasp came loose.",
                              "Color matches the pictures."]),
    },
    "Video Games": {
        "Nintendo Switch Accessories": (["Game Card Case", "Carrying Case", "Joy-Con Charging Dock",
                                         "Screen Protector for Switch", "Pro Controller"], (9, 75),
                                        ["Holds all my game cards with room to spare.", "The zipper feels cheap.",
                                         "Charges four controllers at once.", "Fits the OLED model too."]),
        "PlayStation Accessories": (["Controller Charging Station", "Headset Stand", "Cooling Fan",
                                     "Thumb Grips"], (8, 60),
                                    ["Keeps the console quiet and cool.", "The lights are too bright at night.",
                                     "Controllers click right in."]),
        "Xbox Accessories": (["Rechargeable Battery Pack", "Wireless Controller", "Vertical Stand"], (10, 70),
                             ["Battery lasts more than a day of gaming.", "The stand wobbles a little.",
                              "Paired with the console immediately."]),
        "PC Gaming": (["RGB Gaming Mouse", "Gaming Headset", "Gaming Keyboard", "Mouse Bungee"], (15, 150),
                      ["The RGB software is clunky.", "Very precise sensor.", "The microphone sounds muffled."]),
    },
    "Home & Kitchen": {
        "Cookware": (["Nonstick Frying Pan", "Cast Iron Skillet", "Stainless Steel Saucepan", "Dutch Oven",
                      "Wok with Lid"], (18, 220),
                     ["Heats evenly on my gas stove.", "The coating started peeling.", "Heavier than I expected.",
                      "Cleans up in seconds."]),
        "Coffee & Tea": (["French Press", "Pour Over Coffee Maker", "Electric Kettle", "Tea Infuser Set",
                          "Burr Coffee Grinder"], (12, 160),
                         ["Makes a smooth cup every morning.", "The lid does not seal well.",
                          "Boils water really fast.", "The grind size is very consistent."]),
        "Storage & Organization": (["Stackable Storage Bins", "Drawer Organizer", "Vacuum Storage Bags",
                                    "Spice Rack"], (10, 60),
                                   ["Made my pantry look tidy.", "Thinner plastic than pictured.",
                                    "Everything fits nicely."]),
        "Bedding": (["Cotton Sheet Set", "Down Alternative Comforter", "Memory Foam Pillow", "Weighted Blanket"],
                    (20, 180),
                    ["So soft after the first wash.", "Sleeps a little warm.", "The color faded after washing.",
                     "Helped me sleep through the night."]),
    },
    "Beauty & Personal Care": {
        "Skin Care": (["Hydrating Face Moisturizer", "Vitamin C Serum", "Gentle Foaming Cleanser", "Sunscreen SPF 50",
                       "Night Repair Cream"], (8, 90),
                      ["My skin feels hydrated all day.", "Broke me out after a week.", "No greasy residue.",
                       "The scent is too strong."]),
        "Hair Care": (["Argan Oil Shampoo", "Deep Conditioner", "Hair Dryer 1875W", "Ceramic Flat Iron"], (9, 120),
                      ["Left my hair shiny and smooth.", "Dries my hair in minutes.", "The cord is too short."]),
        "Oral Care": (["Electric Toothbrush", "Water Flosser", "Night Guard for Teeth Grinding",
                       "Whitening Strips"], (10, 110),
                      ["The mouth guard stopped my jaw bruxism pain.", "Battery lasts two weeks.",
                       "Too bulky for my mouth.", "My dentist noticed the difference."]),
        "Fragrance": (["Eau de Parfum", "Body Mist", "Cologne Spray"], (15, 140),
                      ["The scent lasts all day.", "Smells different from the sample.", "Lovely gift box."]),
    },
    "Health & Household": {
        "Vitamins": (["Vitamin D3 Softgels", "Multivitamin Gummies", "Omega-3 Fish Oil", "Magnesium Glycinate"],
                     (8, 45),
                     ["Easy to swallow.", "The gummies taste great.", "No fishy aftertaste."]),
        "Household Supplies": (["Laundry Detergent Pods", "Paper Towels 12 Rolls", "Dish Soap Refill",
                                "Trash Bags 13 Gallon"], (6, 40),
                               ["Great value for the price.", "The bags tear easily.", "Cleans well in cold water."]),
        "Medical Supplies": (["Digital Thermometer", "Blood Pressure Monitor", "First Aid Kit",
                              "Pulse Oximeter"], (10, 80),
                             ["Readings match my doctor's office.", "Instructions were unclear.",
                              "Compact enough for the car."]),
        "Sleep & Snoring": (["Anti Snoring Chin Strap", "Sleep Mask", "White Noise Machine"], (9, 55),
                            ["I finally sleep through the night.", "The strap is uncomfortable.",
                             "Blocks out all light."]),
    },
    "Sports & Outdoors": {
        "Camping": (["Two Person Tent", "Sleeping Bag", "Camping Lantern", "Portable Camp Stove"], (20, 250),
                    ["Set up in ten minutes.", "Stayed dry in heavy rain.", "The zipper snagged constantly."]),
        "Fitness": (["Yoga Mat", "Adjustable Dumbbells", "Resistance Bands Set", "Jump Rope"], (10, 300),
                    ["Good grip even when sweaty.", "The smell faded after a few days.", "Sturdy and well made."]),
        "Cycling": (["Bike Helmet", "Bike Lock", "LED Bike Light Set", "Padded Cycling Shorts"], (12, 120),
                    ["Bright enough for night rides.", "The lock feels very secure.", "Runs a size small."]),
        "Water Sports": (["Swim Goggles", "Inflatable Paddle Board", "Snorkel Set", "Dry Bag"], (10, 400),
                         ["No leaks at all.", "Fogs up quickly.", "Kept my phone dry on the kayak."]),
    },
    "Clothing, Shoes & Jewelry": {
        "Women's Clothing": (["Casual Summer Dress", "Knit Cardigan Sweater", "High Waist Leggings", "Rain Jacket"],
                             (15, 120),
                             ["Runs true to size.", "The fabric is thinner than expected.", "Very flattering fit."]),
        "Men's Clothing": (["Crew Neck T-Shirt 3 Pack", "Slim Fit Chino Pants", "Fleece Hoodie", "Puffer Vest"],
                           (15, 110),
                           ["Shrank after the first wash.", "Comfortable and warm.", "Colors are accurate."]),
        "Shoes": (["Running Shoes", "Leather Ankle Boots", "Slip-On Sneakers", "Hiking Boots"], (30, 180),
                  ["Comfortable right out of the box.", "The soles wore out quickly.", "Order half a size up."]),
        "Jewelry": (["Sterling Silver Necklace", "Gold Hoop Earrings", "Charm Bracelet", "Birthstone Ring"],
                    (12, 200),
                    ["Beautiful and delicate.", "Tarnished after a month.", "Came in a lovely box."]),
    },
    "Office Products": {
        "Writing Supplies": (["Gel Pens 12 Pack", "Fountain Pen", "Mechanical Pencil Set", "Highlighters"], (5, 60),
                             ["Writes smoothly without smudging.", "Ink dried out quickly.",
                              "Nice weight in the hand."]),
        "Paper & Notebooks": (["Dotted Journal", "Spiral Notebook 5 Pack", "Sticky Notes Value Pack",
                               "Printer Paper Ream"], (5, 45),
                              ["No bleed through with my pens.", "The binding fell apart.", "Great for planning."]),
        "Desk Organization": (["Desk Organizer", "Monitor Riser", "File Holder", "Cable Management Box"], (10, 70),
                              ["Cleared up my whole desk.", "Easy to assemble.", "A bit wobbly."]),
        "Office Furniture": (["Ergonomic Office Chair", "Standing Desk Converter", "Footrest", "Desk Lamp"],
                             (25, 400),
                             ["My back pain is gone.", "Assembly took over an hour.", "Sturdy and adjustable."]),
    },
    "Tools & Home Improvement": {
        "Power Tools": (["Cordless Drill Driver", "Orbital Sander", "Circular Saw", "Impact Driver"], (40, 280),
                        ["Plenty of power for decking screws.", "Battery drains fast.", "Well balanced and light."]),
        "Hand Tools": (["Screwdriver Set", "Socket Wrench Set", "Claw Hammer", "Tape Measure 25ft"], (8, 120),
                       ["The bits feel solid.", "Rusted after a month in the garage.", "Handy case included."]),
        "Lighting": (["LED Light Bulbs 6 Pack", "Motion Sensor Night Light", "Smart Light Strip", "Work Light"],
                     (9, 90),
                     ["Bright and warm light.", "The app keeps disconnecting.", "Easy to install."]),
        "Smart Home": (["Smart Plug 4 Pack", "Video Doorbell", "Smart Thermostat", "Indoor Security Camera"],
                       (20, 250),
                       ["Works with voice assistants.", "Setup took minutes.", "Night vision is blurry."]),
    },
    "Patio, Lawn & Garden": {
        "Gardening": (["Garden Hose 50ft", "Pruning Shears", "Raised Garden Bed", "Gardening Gloves"], (8, 150),
                      ["My tomatoes love it.", "Leaks at the connector.", "Sharp and comfortable."]),
        "Outdoor Decor": (["Solar Path Lights", "Outdoor String Lights", "Wind Chime", "Bird Feeder"], (10, 90),
                          ["Charges even on cloudy days.", "Stopped working after the first storm.",
                           "The birds found it the first day."]),
        "Grills & Outdoor Cooking": (["Charcoal Grill", "Grill Brush", "Pizza Oven", "BBQ Tool Set"], (12, 350),
                                     ["Reaches high heat quickly.", "Rusted over the winter.",
                                      "Great for summer parties."]),
        "Pest Control": (["Mosquito Repellent Lantern", "Mouse Traps 6 Pack", "Ultrasonic Pest Repeller"], (8, 50),
                         ["Caught mice the first night.", "Did nothing against ants.", "Quiet and discreet."]),
    },
    "Grocery & Gourmet Food": {
        "Snacks": (["Mixed Nuts Jar", "Protein Bars 12 Count", "Kettle Potato Chips", "Dried Mango Slices"], (4, 35),
                   ["Tasty and filling.", "Arrived stale.", "Perfect for road trips."]),
        "Beverages": (["Green Tea Bags 100 Count", "Cold Brew Coffee Concentrate", "Sparkling Water 24 Pack",
                       "Hot Cocoa Mix"], (5, 40),
                      ["Smooth and not bitter.", "Too sweet for my taste.", "My new morning favorite."]),
        "Pantry Staples": (["Extra Virgin Olive Oil", "Basmati Rice 10 lb", "Organic Maple Syrup", "Sea Salt Grinder"],
                           (5, 45),
                           ["Authentic flavor.", "The bottle arrived leaking.", "Great price for the quality."]),
        "Candy & Chocolate": (["Dark Chocolate Bar Variety Pack", "Gummy Bears 5 lb", "Salted Caramels",
                               "Peppermint Tins"], (4, 40),
                              ["Rich and not too sweet.", "Melted during shipping.", "A hit with the kids."]),
    },
}

BRANDS = {
    "Electronics": ["Soundcore", "Auralis", "Voltix", "Nexbeat", "Kinetica", "Lumora", "Brightway", "Zentro"],
    "Cell Phones & Accessories": ["Spigen", "Casetech", "Orbix", "Gripline", "Vuvu", "Armorix", "Clearo"],
    "Video Games": ["HEIYING", "Gamexa", "Pixelport", "Joyforge", "Controlla", "Levelup"],
    "Home & Kitchen": ["Cuisina", "Homely", "Ironwood", "Brewmaster", "Nestly", "Pantrio", "Dreamweave"],
    "Beauty & Personal Care": ["Glowlab", "Puraderm", "Silkara", "Denta", "Aromis", "Verdeen"],
    "Health & Household": ["Vitacore", "Purehome", "Medisure", "Sleepwell", "Cleanrite", "Naturis"],
    "Sports & Outdoors": ["Trailmark", "Peakform", "Aquaflo", "Ridgeline", "Velocore", "Summitry"],
    "Clothing, Shoes & Jewelry": ["Urbanthread", "Northloom", "Stridewell", "Aurelia", "Cottonfield", "Kestrel"],
    "Office Products": ["Inkwell", "Deskpro", "Papercraft", "Ergolux", "Noteworthy", "Officio"],
    "Tools & Home Improvement": ["Boltforge", "Craftline", "Lumenix", "Hometek", "Torqline", "Smartnest"],
    "Patio, Lawn & Garden": ["Greenthumb", "Sunpath", "Yardcraft", "Emberly", "Backyardly", "Bugaway"],
    "Grocery & Gourmet Food": ["Harvest Hill", "Nutty Grove", "Brewhouse", "Olivia Farms", "Sweetbay", "Pantry Co"],
}

ADJECTIVES = ["Premium", "Classic", "Pro", "Ultra", "Essential", "Deluxe", "Compact", "Everyday", "Advanced",
              "Lightweight", "Heavy Duty", "Eco", "Signature", "Original", "Plus"]
COLORS = ["Black", "White", "Navy Blue", "Gray", "Red", "Rose Gold", "Forest Green", "Silver", "Beige", "Purple",
          "Teal", "Charcoal"]
FEATURES = ["for Home and Office", "with Travel Case", "2 Pack", "Gift Edition", "for Men and Women",
            "with 2-Year Warranty", "Value Bundle", "Upgraded Version", "Large", "Small", "XL", "Set of 3"]

FIRST = ["Joseph", "Michelle", "Catherine", "Daniel", "Sofia", "Liam", "Olivia", "Noah", "Ava", "Ethan", "Mia",
         "Lucas", "Amelia", "Mason", "Harper", "Logan", "Evelyn", "Aiden", "Abigail", "Jackson", "Emily", "Samuel",
         "Grace", "Henry", "Chloe", "Owen", "Lily", "Wyatt", "Zoe", "Julian", "Nora", "Levi", "Hannah", "Isaac",
         "Aria", "Gabriel", "Layla", "Anthony", "Scarlett", "Dylan", "Priya", "Kenji", "Fatima", "Mateo", "Ingrid",
         "Tomasz", "Aisha", "Rafael", "Yuki", "Omar"]
LAST = ["Brzezinski", "Davis", "Nguyen", "Patel", "Garcia", "Smith", "Johnson", "Williams", "Brown", "Jones",
        "Miller", "Wilson", "Moore", "Taylor", "Anderson", "Thomas", "Jackson", "White", "Harris", "Martin",
        "Thompson", "Martinez", "Robinson", "Clark", "Rodriguez", "Lewis", "Lee", "Walker", "Hall", "Allen",
        "Young", "King", "Wright", "Scott", "Green", "Baker", "Adams", "Nelson", "Hill", "Campbell", "Okafor",
        "Kowalski", "Haddad", "Tanaka", "Fischer", "Rossi", "Dubois", "Silva", "Novak", "Larsen"]
NICKNAMES = ["Catso", "Dibbins", "Anglebert Dinkherhump", "gadgetgal", "TechDad42", "QuietReader", "BargainHunter",
             "mom_of_three", "RunnerRick", "HomeChefJo", "NightOwl", "the_reviewer", "PlantLady", "DIY_Dave"]

POSITIVE = ["Really happy with this purchase.", "Exactly as described.", "Would buy again.",
            "Great quality for the price.", "Exceeded my expectations.", "Five stars from me."]
NEUTRAL = ["It does the job.", "Decent, but nothing special.", "Okay for the price.", "Mixed feelings about it."]
NEGATIVE = ["Disappointed overall.", "Would not recommend.", "Returned it.", "Not worth the money."]
TITLES = {5: ["Love it", "Excellent", "Perfect", "Highly recommend"], 4: ["Very good", "Solid choice", "Happy"],
          3: ["It's okay", "Average", "Could be better"], 2: ["Meh", "Not great", "Some issues"],
          1: ["Terrible", "Broke quickly", "Avoid"]}

CITIES = [("Pittsburgh", "Pennsylvania", "15213"), ("Austin", "Texas", "78701"), ("Seattle", "Washington", "98101"),
          ("Denver", "Colorado", "80202"), ("Boston", "Massachusetts", "02108"), ("Chicago", "Illinois", "60601"),
          ("Portland", "Oregon", "97201"), ("Miami", "Florida", "33101")]
STREETS = ["Forbes Ave", "Oak Street", "Maple Drive", "Cedar Lane", "Pine Road", "Elm Court", "Lake View Blvd"]
SHIPPING = {"flatrate": ("Flat Rate", 500), "express": ("Express Shipping", 1500), "freeshipping": ("Free Shipping", 0)}


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def password_hash(password: str, salt: str) -> str:
    """``salt$hex`` with PBKDF2-SHA256 (few rounds: this is a benchmark shop)."""
    return salt + "$" + hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), 1000).hex()


def _sku(rng: random.Random, used: set[str]) -> str:
    while True:
        sku = "B0" + "".join(rng.choice("0123456789ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(8))
        if sku not in used:
            used.add(sku)
            return sku


def _price(rng: random.Random, lo: int, hi: int) -> int:
    dollars = rng.randint(lo, hi - 1)
    return dollars * 100 + rng.choice([99, 99, 95, 49, 0, 89, 29])


def _description(rng: random.Random, name: str, brand: str, noun: str, color: str, remarks: list[str]) -> str:
    lines = [
        f"The {brand} {noun} is built for everyday use and designed to last.",
        f"Finish: {color}. Backed by {brand}'s customer support team.",
        rng.choice(["Ships in recyclable packaging.", "Includes a quick start guide.", "Lab tested for safety."]),
        rng.choice(["Customers love its reliability.", "A bestseller in its category.", "Our editors' pick."]),
    ]
    return " ".join(lines)


def _review(rng: random.Random, remarks: list[str], nickname: str) -> tuple[int, str, str]:
    rating = rng.choices([5, 4, 3, 2, 1], weights=[38, 27, 14, 9, 12])[0]
    pool = POSITIVE if rating >= 4 else NEUTRAL if rating == 3 else NEGATIVE
    parts = [rng.choice(pool)]
    if rng.random() < 0.55:
        parts.append(rng.choice(remarks))
    parts.append(rng.choice(pool))
    return rating, rng.choice(TITLES[rating]), " ".join(parts)


def generate(path: str) -> None:
    """Write the whole shop database to ``path`` (replacing it)."""
    if os.path.exists(path):
        os.unlink(path)
    rng = random.Random(SEED)
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    cat_id = 0
    skus: set[str] = set()
    slugs: set[str] = set()
    products = []  # (id, name, sku, price)
    for cat, subs in CATALOG.items():
        cat_id += 1
        parent = cat_id
        cslug = slugify(cat)
        db.execute("INSERT INTO categories VALUES (?, NULL, ?, ?, ?)", (parent, cat, cslug, cslug))
        for sub, (nouns, (lo, hi), remarks) in subs.items():
            cat_id += 1
            sslug = slugify(sub)
            db.execute("INSERT INTO categories VALUES (?, ?, ?, ?, ?)",
                       (cat_id, parent, sub, sslug, f"{cslug}/{sslug}"))
            made = 0
            while made < PER_SUBCATEGORY:
                brand, noun = rng.choice(BRANDS[cat]), rng.choice(nouns)
                color, adj, feat = rng.choice(COLORS), rng.choice(ADJECTIVES), rng.choice(FEATURES)
                name = f"{brand} {adj} {noun}, {feat}, {color}"
                slug = slugify(name)
                if slug in slugs:
                    continue
                slugs.add(slug)
                made += 1
                sku, price = _sku(rng, skus), _price(rng, lo, hi)
                day = f"2022-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
                cur = db.execute(
                    "INSERT INTO products (sku, name, slug, category_id, brand, color, price_cents, description, "
                    "stock, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (sku, name, slug, cat_id, brand, color, price,
                     _description(rng, name, brand, noun, color, remarks), rng.choice([0, 3, 12, 25, 40, 100, 100]),
                     day))
                pid = cur.lastrowid
                products.append((pid, name, sku, price))
                for _ in range(rng.choice([0, 0, 1, 2, 3, 4, 5, 6, 8, 10, 14])):
                    nick = (rng.choice(NICKNAMES) if rng.random() < 0.12
                            else f"{rng.choice(FIRST)} {rng.choice(LAST)}")
                    rating, title, body = _review(rng, remarks, nick)
                    created = f"2023-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
                    db.execute("INSERT INTO reviews (product_id, customer_id, nickname, rating, title, body, created)"
                               " VALUES (?, NULL, ?, ?, ?, ?, ?)", (pid, nick, rating, title, body, created))
    _customers_and_orders(db, rng, products)
    db.commit()
    db.execute("VACUUM")
    db.close()


def _customers_and_orders(db: sqlite3.Connection, rng: random.Random, products: list) -> None:
    people = [("Emma", "Lopez", DEFAULT_EMAIL, DEFAULT_PASSWORD)]
    for i in range(59):
        first, last = FIRST[i % len(FIRST)], LAST[(i * 7 + 3) % len(LAST)]
        people.append((first, last, f"{first.lower()}.{last.lower()}{i}@example.com", f"Secret.{i:03d}"))
    for cid, (first, last, email, pw) in enumerate(people, start=1):
        city, region, postcode = CITIES[0] if cid == 1 else rng.choice(CITIES)
        street = "101 S San Mateo Dr" if cid == 1 else f"{rng.randint(10, 9999)} {rng.choice(STREETS)}"
        phone = "6505551212" if cid == 1 else f"555{rng.randint(1000000, 9999999)}"
        db.execute("INSERT INTO customers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                   (cid, email, password_hash(pw, f"s{cid:04d}"), first, last, phone, street, city, region,
                    postcode, "United States", "2022-01-15"))
    # orders: customer 1 (the benchmark's account) has a history of 24; others 0-5 each
    number = 149
    plan = [(1, n) for n in range(24)] + [(c, n) for c in range(2, 61) for n in range(rng.randint(0, 5))]
    rng.shuffle(plan)
    day = 0
    for cid, _ in plan:
        number += 1
        day += rng.randint(1, 3)
        year, doy = 2022 + day // 360, day % 360
        created = f"{year}-{doy // 30 + 1:02d}-{doy % 30 + 1:02d} {rng.randint(8, 22):02d}:{rng.randint(0, 59):02d}:00"
        status = rng.choices(["complete", "canceled", "pending", "processing"], weights=[70, 12, 10, 8])[0]
        items = rng.sample(products, rng.choice([1, 1, 2, 2, 3, 4]))
        qtys = [rng.choice([1, 1, 1, 2, 3]) for _ in items]
        subtotal = sum(p[3] * q for p, q in zip(items, qtys, strict=True))
        method = rng.choice(["flatrate", "flatrate", "express", "freeshipping"])
        label, ship = SHIPPING[method]
        row = db.execute("SELECT first_name, last_name, street, city, region, postcode, country FROM customers "
                         "WHERE id = ?", (cid,)).fetchone()
        cur = db.execute(
            "INSERT INTO orders (number, customer_id, created, status, ship_name, ship_street, ship_city, ship_region,"
            " ship_postcode, ship_country, shipping_method, shipping_cents, payment_method, subtotal_cents,"
            " total_cents) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (f"{number:09d}", cid, created, status, f"{row[0]} {row[1]}", *row[2:], label, ship,
             "Check / Money order", subtotal, subtotal + ship))
        for p, q in zip(items, qtys, strict=True):
            db.execute("INSERT INTO order_items (order_id, product_id, name, sku, price_cents, qty) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (cur.lastrowid, p[0], p[1], p[2], p[3], q))
    # the benchmark account starts with two items in its cart and one on its wish list
    cart = rng.sample(products, 2)
    for p in cart:
        db.execute("INSERT INTO cart_items (owner, product_id, qty) VALUES (?, ?, 1)", ("customer:1", p[0]))
    db.execute("INSERT INTO wishlist_items (customer_id, product_id, added) VALUES (1, ?, '2023-03-02')",
               (rng.choice(products)[0],))
    db.execute("INSERT INTO sessions (token, customer_id, created) VALUES (?, 1, '2023-06-01 09:00:00')",
               (AUTH_TOKEN,))


def storage_state(url: str) -> dict:
    """Playwright storage state (cookies) of the benchmark account signed in at ``url``."""
    host = url.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
    return {"cookies": [{"name": "shop_session", "value": AUTH_TOKEN, "domain": host, "path": "/", "expires": -1,
                         "httpOnly": True, "secure": False, "sameSite": "Lax"}], "origins": []}


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="generate the shop database and the stored sign-in state")
    ap.add_argument("db")
    ap.add_argument("--auth", help="write the signed-in storage state (JSON) here")
    ap.add_argument("--url", default="http://127.0.0.1:7770", help="the site's URL (for the cookie's domain)")
    args = ap.parse_args()
    generate(args.db)
    if args.auth:
        os.makedirs(os.path.dirname(os.path.abspath(args.auth)), exist_ok=True)
        with open(args.auth, "w") as f:
            json.dump(storage_state(args.url), f, indent=1)


if __name__ == "__main__":
    main()
