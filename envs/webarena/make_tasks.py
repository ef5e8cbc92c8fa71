"""Writes the shipped task suite (``envs/webarena/tasks/<task_id>.json``) from the shop's data.

The answers come from the database the image generates (same seed, same data), so a
change of the catalog generator is followed by ``python -m bunshin_gym.envs.webarena.make_tasks``
and the oracle tests. Each task is a WebArena config plus ``oracle``: actions that solve it,
naming elements by tree line (``click [link 'My Account']``).
"""

from __future__ import annotations

import json
import sqlite3
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "shop"))

import catalog  # noqa: E402

S = "__SHOPPING__"


def cfg(tid: int, intent: str, start: str, ev: dict, oracle: list[str], login: bool = True,
        template: str | None = None, inst: dict | None = None, template_id: int = 0) -> dict:
    return {
        "sites": ["shopping"], "task_id": tid, "require_login": login,
        "storage_state": "./.auth/shopping_state.json" if login else None, "start_url": start,
        "geolocation": None, "intent_template": template or intent, "instantiation_dict": inst or {},
        "intent": intent, "require_reset": False, "eval": ev, "intent_template_id": template_id,
        "oracle": oracle,
    }


def string_eval(must_include: list[str] | None = None, exact: str | None = None, fuzzy: list[str] | None = None,
                raw: str = "") -> dict:
    answers: dict = {}
    if must_include is not None:
        answers["must_include"] = must_include
    if exact is not None:
        answers["exact_match"] = exact
    if fuzzy is not None:
        answers["fuzzy_match"] = fuzzy
    return {"eval_types": ["string_match"], "reference_answers": answers, "reference_url": "", "program_html": [],
            "string_note": "", "reference_answer_raw_annotation": raw}


def url_eval(url: str) -> dict:
    return {"eval_types": ["url_match"], "reference_answers": None, "reference_url": url, "program_html": [],
            "url_note": "GOLD in PRED"}


def html_eval(checks: list[dict], url: str | None = None) -> dict:
    ev = {"eval_types": ["program_html"], "reference_answers": None, "reference_url": "", "program_html": checks}
    if url:
        ev["eval_types"] = ["url_match", "program_html"]
        ev["reference_url"] = url
        ev["url_note"] = "GOLD in PRED"
    return ev


def check(url: str, locator: str, must_include: list[str] | None = None, exact: str | None = None) -> dict:
    return {"url": url, "locator": locator,
            "required_contents": {"must_include": must_include} if must_include is not None else
            {"exact_match": exact}}


def money(cents: int) -> str:
    return f"${cents / 100:,.2f}"


def build(db: sqlite3.Connection) -> list[dict]:
    q = lambda sql, *a: db.execute(sql, a).fetchall()  # noqa: E731
    one = lambda sql, *a: db.execute(sql, a).fetchone()  # noqa: E731
    prod = lambda pid: one("SELECT * FROM products WHERE id = ?", pid)  # noqa: E731
    tasks = []
    search = "type [searchbox 'Search'] [{}] [1]"

    # ---- string_match: facts on product pages
    p = prod(12)
    tasks.append(cfg(1001, f"What is the price of the {p['name']}?", S,
                     string_eval(must_include=[f"{p['price_cents'] / 100:.2f}"], raw=money(p["price_cents"])),
                     [search.format("Voltix Pro Wireless Over-Ear Headphones"), f"click [link '{p['name']}']",
                      f"stop [{money(p['price_cents'])}]"], template="What is the price of the {{product}}?",
                     inst={"product": p["name"]}, template_id=9001))
    names = [r[0] for r in q("SELECT DISTINCT nickname FROM reviews WHERE product_id = 12 AND body LIKE "
                             "'%ear cups are too small%' ORDER BY nickname")]
    tasks.append(cfg(1002, "List out reviewers, if exist, who mention about ear cups being small",
                     f"{S}/{p['slug']}.html", string_eval(must_include=names, raw=", ".join(names)),
                     ["scroll [down]", f"stop [{', '.join(names)}]"],
                     template="List out reviewers, if exist, who mention about {{description}}",
                     inst={"description": "ear cups being small"}, template_id=222))
    p = prod(1840)
    n = one("SELECT count(*) FROM reviews WHERE product_id = ?", p["id"])[0]
    tasks.append(cfg(1003, f"How many reviews does the {p['name']} have?", S,
                     string_eval(must_include=[str(n)], raw=str(n)),
                     [search.format("Lumenix Everyday Video Doorbell"), f"click [link '{p['name']}']", f"stop [{n}]"],
                     template_id=9003))
    p = prod(45)
    tasks.append(cfg(1004, f"What is the SKU of the {p['name']}?", S,
                     string_eval(must_include=[p["sku"]], raw=p["sku"]),
                     ["click [link 'Electronics']", "click [link 'Headphones']",
                      search.format("Auralis Pro Wireless Over-Ear"), f"click [link '{p['name']}']",
                      f"stop [{p['sku']}]"], template_id=9004))
    avg = one("SELECT round(avg(rating), 1) FROM reviews WHERE product_id = ?", p["id"])[0]
    tasks.append(cfg(1005, f"What is the average customer rating (out of 5) of the {p['name']}?",
                     f"{S}/{p['slug']}.html", string_eval(must_include=[f"{avg:.1f}"], raw=f"{avg:.1f}"),
                     [f"stop [{avg:.1f} out of 5]"], template_id=9005))

    # ---- string_match: the account's orders
    o = one("SELECT * FROM orders WHERE number = '000000277'")
    tasks.append(cfg(1006, "What is the grand total of my order #000000277?", S,
                     string_eval(must_include=[f"{o['total_cents'] / 100:.2f}"], raw=money(o["total_cents"])),
                     ["click [link 'My Account']", "click [link 'My Orders']", "click [link '000000277']",
                      f"stop [{money(o['total_cents'])}]"], template_id=9006))
    o = one("SELECT * FROM orders WHERE number = '000000221'")
    tasks.append(cfg(1007, "On which date did I place order #000000221?", S,
                     string_eval(fuzzy=["May 29, 2022"], raw="5/29/22"),
                     ["click [link 'My Account']", "click [link 'My Orders']", "click [link 'Page 2']",
                      "click [link '000000221']", "stop [May 29, 2022]"], template_id=9007))
    latest = one("SELECT * FROM orders WHERE customer_id = 1 ORDER BY created DESC LIMIT 1")
    tasks.append(cfg(1008, "What is the status of my most recent order? Answer with the status only.", S,
                     string_eval(exact=latest["status"].title(), raw=latest["status"].title()),
                     ["click [link 'My Account']", "click [link 'My Orders']", f"stop [{latest['status'].title()}]"],
                     template_id=9008))
    canceled = one("SELECT count(*) FROM orders WHERE customer_id = 1 AND status = 'canceled'")[0]
    tasks.append(cfg(1009, "How many of my orders were canceled?", S,
                     string_eval(must_include=[str(canceled)], raw=str(canceled)),
                     ["click [link 'My Account']", "click [link 'My Orders']", "click [link 'Page 2']",
                      "click [link 'Page 3']", f"stop [{canceled}]"], template_id=9009))
    spent = one("SELECT sum(total_cents) FROM orders WHERE customer_id = 1 AND status != 'canceled' AND "
                "created LIKE '2022-10-%'")[0]
    tasks.append(cfg(1010, "How much did I spend on shopping in October 2022? Leave out canceled orders.", S,
                     string_eval(must_include=[f"{spent / 100:.2f}"], raw=money(spent)),
                     ["click [link 'My Account']", "click [link 'My Orders']", f"stop [{money(spent)}]"],
                     template="How much did I spend on shopping in {{month}}? Leave out canceled orders.",
                     inst={"month": "October 2022"}, template_id=9010))
    item = one("SELECT oi.name FROM order_items oi JOIN orders o ON o.id = oi.order_id WHERE o.number = '000000246'")
    tasks.append(cfg(1011, "Which product did I buy in order #000000246?", S,
                     string_eval(fuzzy=[item[0].split(",")[0]], raw=item[0]),
                     ["click [link 'My Account']", "click [link 'My Orders']", "click [link '000000246']",
                      f"stop [{item[0]}]"], template_id=9011))

    # ---- string_match: catalog browsing with sorting and filters
    cheap = one("SELECT p.name FROM products p JOIN categories c ON c.id = p.category_id WHERE "
                "c.path = 'electronics/headphones' ORDER BY p.price_cents, p.id LIMIT 1")[0]
    tasks.append(cfg(1012, "What is the cheapest product in the Headphones category?", S,
                     string_eval(must_include=[cheap.split(",")[0]], raw=cheap),
                     ["click [link 'Electronics']", "click [link 'Headphones']", "click [link 'Price: Low to High']",
                      f"stop [{cheap}]"], template_id=9012))
    n = one("SELECT count(*) FROM products p JOIN categories c ON c.id = p.category_id WHERE "
            "c.path = 'sports-outdoors/cycling' AND p.price_cents >= 5000 AND p.price_cents < 10000")[0]
    tasks.append(cfg(1013, "How many products in the Cycling category cost from $50.00 to $99.99?", S,
                     string_eval(must_include=[str(n)], raw=str(n)),
                     ["click [link 'Sports & Outdoors']", "click [link 'Cycling']", "click [link '$50.00 - $99.99']",
                      f"stop [{n}]"], template_id=9013))
    brand = one("SELECT brand, count(*) n FROM products p JOIN categories c ON c.id = p.category_id WHERE "
                "c.path = 'tools-home-improvement/smart-home' GROUP BY brand ORDER BY n DESC LIMIT 1")[0]
    tasks.append(cfg(1014, "Which brand has the most products in the Smart Home category?",
                     f"{S}/tools-home-improvement.html", string_eval(exact=brand, raw=brand),
                     ["click [link 'Smart Home']", f"stop [{brand}]"], template_id=9014))
    top = one("SELECT p.name, avg(r.rating) a, count(r.id) n FROM products p JOIN categories c ON c.id = p.category_id "
              "LEFT JOIN reviews r ON r.product_id = p.id WHERE c.path = 'beauty-personal-care/fragrance' "
              "GROUP BY p.id ORDER BY coalesce(a, 0) DESC, n DESC, p.id LIMIT 1")[0]
    tasks.append(cfg(1015, "Which product of the Fragrance category has the best customer rating?", S,
                     string_eval(must_include=[top.split(",")[0]], raw=top),
                     ["click [link 'Beauty & Personal Care']", "click [link 'Fragrance']", "click [link 'Top Rated']",
                      f"stop [{top}]"], template_id=9015))
    c = one("SELECT * FROM customers WHERE id = 1")
    tasks.append(cfg(1016, "What phone number is saved in my default shipping address?", S,
                     string_eval(must_include=[c["phone"]], raw=c["phone"]),
                     ["click [link 'My Account']", "click [link 'Address Book']", f"stop [{c['phone']}]"],
                     template_id=9016))
    cart = [r[0] for r in q("SELECT p.name FROM cart_items ci JOIN products p ON p.id = ci.product_id "
                            "WHERE ci.owner = 'customer:1' ORDER BY ci.id")]
    tasks.append(cfg(1017, "Which products are in my shopping cart right now?", S,
                     string_eval(must_include=[n.split(",")[0] for n in cart], raw="; ".join(cart)),
                     ["click [link 'My Cart (2 items)']", f"stop [{'; '.join(cart)}]"], template_id=9017))
    wish = one("SELECT p.name FROM wishlist_items w JOIN products p ON p.id = w.product_id WHERE w.customer_id = 1")[0]
    tasks.append(cfg(1018, "Which product is on my wish list?", S,
                     string_eval(must_include=[wish.split(",")[0]], raw=wish),
                     ["click [link 'My Wish List']", f"stop [{wish}]"], template_id=9018))

    # ---- url_match
    tasks.append(cfg(1019, "Show me the search results for 'french press', sorted by price from low to high.", S,
                     url_eval(f"{S}/catalogsearch/result/?q=french+press&product_list_order=price_asc"),
                     [search.format("french press"), "click [link 'Price: Low to High']", "stop []"],
                     template_id=9019))
    p = one("SELECT * FROM products WHERE name LIKE '%Dutch Oven%' ORDER BY price_cents DESC LIMIT 1")
    tasks.append(cfg(1020, "Open the page of the most expensive Dutch Oven in the store.", S,
                     url_eval(f"{S}/{p['slug']}.html"),
                     [search.format("dutch oven"), "click [link 'Price: High to Low']", f"click [link '{p['name']}']",
                      "stop []"], template_id=9020))
    tasks.append(cfg(1021, "Show me my order history.", S, url_eval(f"{S}/sales/order/history/"),
                     ["click [link 'My Account']", "click [link 'My Orders']", "stop []"], template_id=9021))
    tasks.append(cfg(1022, "Show me the products of the brand Trailmark in the Camping category.", S,
                     url_eval(f"{S}/sports-outdoors/camping.html?brand=Trailmark"),
                     ["click [link 'Sports & Outdoors']", "click [link 'Camping']", "click [link 'Trailmark']",
                      "stop []"], template_id=9022))
    p = one("SELECT * FROM products WHERE name LIKE 'HEIYING%Game Card Case%' ORDER BY price_cents LIMIT 1")
    tasks.append(cfg(1023, "I want a HEIYING game card case for my Nintendo Switch cards: open the page of the "
                           "cheapest one.", S, url_eval(f"{S}/{p['slug']}.html"),
                     [search.format("HEIYING game card case"), "click [link 'Price: Low to High']",
                      f"click [link '{p['name']}']", "stop []"], template_id=9023))
    o = one("SELECT * FROM orders WHERE number = '000000259'")
    tasks.append(cfg(1024, "Open the details of my order #000000259.", S,
                     url_eval(f"{S}/sales/order/view/order_id/{o['id']}/"),
                     ["click [link 'My Account']", "click [link 'My Orders']", "click [link '000000259']", "stop []"],
                     template_id=9024))

    # ---- program_html: state changes checked on the live pages
    cart_text = "document.querySelector('#shopping-cart-table')?.outerText || ''"
    p = prod(1203)
    tasks.append(cfg(1025, f"Add the {p['name']} to my shopping cart.", S,
                     html_eval([check(f"{S}/checkout/cart/", cart_text, must_include=[p["name"]])]),
                     [search.format(" ".join(p["name"].split(",")[0].split()[:4])), f"click [link '{p['name']}']",
                      "click [button 'Add to Cart']", "stop []"], template_id=9025))
    p = prod(777)
    qty = f"document.querySelector('[aria-label=\"Qty of {p['name']}\"]')?.value || ''"
    tasks.append(cfg(1026, f"Put 3 units of the {p['name']} in my cart.", f"{S}/{p['slug']}.html",
                     html_eval([check(f"{S}/checkout/cart/", qty, exact="3")]),
                     ["type [spinbutton 'Qty'] [3] [0]", "click [button 'Add to Cart']", "stop []"],
                     template_id=9026))
    rows = "document.querySelectorAll('#shopping-cart-table tbody tr').length"
    gone = cart[0]
    tasks.append(cfg(1027, f"Remove the {gone.split(',')[0]} from my shopping cart.", S,
                     html_eval([check(f"{S}/checkout/cart/", rows, exact="1"),
                                check(f"{S}/checkout/cart/", cart_text, must_include=[cart[1]])]),
                     ["click [link 'My Cart (2 items)']", f"click [button 'Remove {gone}']", "stop []"],
                     template_id=9027))
    keep = cart[1]
    qty = f"document.querySelector('[aria-label=\"Qty of {keep}\"]')?.value || ''"
    tasks.append(cfg(1028, f"Change the quantity of the {keep.split(',')[0]} in my cart to 4.", S,
                     html_eval([check(f"{S}/checkout/cart/", qty, exact="4")]),
                     ["click [link 'My Cart (2 items)']", f"type [spinbutton 'Qty of {keep}'] [4] [0]",
                      "click [button 'Update Shopping Cart']", "stop []"], template_id=9028))
    p = prod(951)
    tasks.append(cfg(1029, f"Add the {p['name']} to my wish list.", S,
                     html_eval([check(f"{S}/wishlist/", "", must_include=[p["name"]])]),
                     [search.format(" ".join(p["name"].split(",")[0].split()[:3])), f"click [link '{p['name']}']",
                      "click [button 'Add to Wish List']", "stop []"], template_id=9029))
    p = prod(620)
    tasks.append(cfg(1030, f"Buy the {p['name']} together with what is already in my cart, with express shipping.",
                     f"{S}/{p['slug']}.html",
                     html_eval([check("func:shopping_get_latest_order_url()", "",
                                      must_include=[p["name"], "Express Shipping", cart[0], cart[1]])]),
                     ["click [button 'Add to Cart']", "click [link 'My Cart (3 items)']",
                      "click [link 'Proceed to Checkout']", "click [radio 'Express Shipping $15.00']",
                      "click [button 'Place Order']", "stop []"], template_id=9030))
    p = prod(130)
    summary, detail = "Sturdy and quiet", "I have used it every day for a month and it still works like new."
    reviews = "document.querySelector('#reviews')?.outerText || ''"
    tasks.append(cfg(1031, f"Write a 5-star review of the {p['name']} with the summary \"{summary}\" and the text "
                           f"\"{detail}\", signed with my first name.", f"{S}/{p['slug']}.html",
                     html_eval([check(f"{S}/{p['slug']}.html", reviews, must_include=[summary, detail, "Emma"])]),
                     ["click [radio '5 stars']", f"type [textbox 'Summary'] [{summary}] [0]",
                      f"type [textbox 'Review'] [{detail}] [0]", "click [button 'Submit Review']", "stop []"],
                     template_id=9031))
    tasks.append(cfg(1032, "Change the first name on my account to Emilia.", S,
                     html_eval([check(f"{S}/customer/account/edit/", "document.querySelector('#firstname').value",
                                      exact="Emilia")]),
                     ["click [link 'My Account']", "click [link 'Account Information']",
                      "type [textbox 'First Name'] [Emilia] [0]", "click [button 'Save']", "stop []"],
                     template_id=9032))
    tasks.append(cfg(1033, "I moved: my shipping address is now 742 Evergreen Terrace, Springfield, Oregon 97403. "
                           "Update my address book.", S,
                     html_eval([check(f"{S}/customer/address/", "",
                                      must_include=["742 Evergreen Terrace", "Springfield", "Oregon", "97403"])]),
                     ["click [link 'My Account']", "click [link 'Address Book']",
                      "click [link 'Change Shipping Address']",
                      "type [textbox 'Street Address'] [742 Evergreen Terrace] [0]",
                      "type [textbox 'City'] [Springfield] [0]", "type [textbox 'State/Province'] [Oregon] [0]",
                      "type [textbox 'Zip/Postal Code'] [97403] [0]", "click [button 'Save Address']", "stop []"],
                     template_id=9033))
    tasks.append(cfg(1034, "Subscribe me to the store's newsletter.", S,
                     html_eval([check(f"{S}/newsletter/manage/", "document.querySelector('#subscription').checked",
                                      exact="true")]),
                     ["click [link 'My Account']", "click [link 'Newsletter Subscriptions']",
                      "click [checkbox 'General Subscription']", "click [button 'Save']", "stop []"],
                     template_id=9034))
    o = one("SELECT * FROM orders WHERE number = '000000231'")
    it = one("SELECT * FROM order_items WHERE order_id = ?", o["id"])
    comment = (f"I want a refund for the phone case of order #000000231 (SKU {it['sku']}): it broke after three days "
               "of use.")
    mind = "document.querySelector('[title=\"What’s on your mind?\"]').value"
    tasks.append(cfg(1035, "Fill the \"contact us\" form for a refund on the phone case I bought, stating that it "
                           "broke after three days of use. Include the order number #000000231 and the product SKU. "
                           "Don't submit yet, I will check.", S,
                     html_eval([check("last", mind, must_include=["refund", "broke after three days of use",
                                                                  "000000231", it["sku"]])], url=f"{S}/contact"),
                     ["click [link 'Contact Us']", f"type [textbox 'What’s on your mind?'] [{comment}] [0]",
                      "stop []"], template_id=153))
    o = one("SELECT * FROM orders WHERE number = '000000246'")
    tasks.append(cfg(1036, "Reorder everything from my order #000000246.", S,
                     html_eval([check(f"{S}/checkout/cart/", cart_text, must_include=[item[0]])]),
                     ["click [link 'My Account']", "click [link 'My Orders']", "click [link '000000246']",
                      "click [link 'Reorder']", "stop []"], template_id=9036))
    tasks.append(cfg(1037, f"Sign in with the email {catalog.DEFAULT_EMAIL} and the password "
                           f"{catalog.DEFAULT_PASSWORD}, then open my wish list.", S,
                     url_eval(f"{S}/wishlist/"),
                     ["click [link 'Sign In']", f"type [textbox 'Email'] [{catalog.DEFAULT_EMAIL}] [0]",
                      f"type [textbox 'Password'] [{catalog.DEFAULT_PASSWORD}] [1]", "click [link 'My Wish List']",
                      "stop []"], login=False, template_id=9037))
    p = prod(455)
    tasks.append(cfg(1038, f"Leave a message through the contact form asking whether the {p['name']} "
                           "ships to Canada, and send it.", S,
                     url_eval(f"{S}/contact/?sent=1"),
                     ["click [link 'Contact Us']",
                      f"type [textbox 'What’s on your mind?'] [Does the {p['name']} ship to Canada?] [0]",
                      "click [button 'Submit']", "stop []"], template_id=9038))
    return tasks


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/shop.db"
        catalog.generate(path)
        db = sqlite3.connect(path)
        db.row_factory = sqlite3.Row
        tasks = build(db)
        db.close()
    out = HERE / "tasks"
    out.mkdir(exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    for t in tasks:
        (out / f"{t['task_id']}.json").write_text(json.dumps(t, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(tasks)} tasks to {out}")


if __name__ == "__main__":
    main()
