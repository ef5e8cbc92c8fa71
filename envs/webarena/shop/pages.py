"""HTML of the shop's pages (server-side rendered, accessible markup, no JavaScript needed).

Each function returns ``(title, body_html)``; :func:`layout` wraps a body in the header,
navigation and footer shared by every page.
"""

from __future__ import annotations

from html import escape
from urllib.parse import urlencode

from store import ORDERS_PAGE, PAGE_SIZE, SORTS, Query, money

SITE_NAME = "One Stop Market"
STYLE = """
body{font-family:DejaVu Sans,Arial,sans-serif;margin:0;color:#333;font-size:14px}
header{background:#f4f4f4;padding:8px 20px;border-bottom:1px solid #ddd}
header .links{list-style:none;margin:0;padding:0;text-align:right}
header .links li{display:inline;margin-left:14px}
.top{display:flex;align-items:center;gap:20px;margin-top:6px}.logo{font-size:22px;font-weight:bold;color:#1979c3}
form.search{flex:1}form.search input{width:60%;padding:6px}
nav.categories{background:#1979c3;padding:6px 20px}nav.categories a{color:#fff;margin-right:12px;text-decoration:none}
main{padding:10px 20px;display:flex;gap:24px}main>.content{flex:1}aside{width:220px}
.grid{display:grid;grid-template-columns:repeat(4,1fr);gap:16px;list-style:none;padding:0}
.grid li{border:1px solid #eee;padding:8px}.price{font-weight:bold;font-size:16px}
.msg{padding:8px;margin:6px 0;background:#e5efe5;border:1px solid #9c9}.err{background:#fdf0d5;border-color:#c96}
table{border-collapse:collapse}td,th{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left}
footer{padding:14px 20px;border-top:1px solid #ddd;margin-top:20px}footer a{margin-right:14px}
.review{border-bottom:1px solid #eee;padding:6px 0}
"""


def e(value) -> str:
    return escape(str(value if value is not None else ""), quote=True)


def stars(rating: float) -> str:
    return f"{round(rating / 5 * 100)}%"


def layout(title: str, body: str, *, customer=None, cart_count: int = 0, categories=(), messages=(),
           query: str = "") -> str:
    if customer is not None:
        links = (f'<li>Welcome, {e(customer["first_name"])} {e(customer["last_name"])}!</li>'
                 '<li><a href="/customer/account/">My Account</a></li><li><a href="/wishlist/">My Wish List</a></li>'
                 '<li><a href="/customer/account/logout/">Sign Out</a></li>')
    else:
        links = ('<li>Default welcome msg!</li><li><a href="/customer/account/login/">Sign In</a></li>'
                 '<li><a href="/customer/account/create/">Create an Account</a></li>')
    nav = "".join(f'<a href="/{e(c["path"])}.html">{e(c["name"])}</a>' for c in categories)
    msgs = "".join(f'<div role="alert" class="msg{" err" if kind == "error" else ""}">{e(text)}</div>'
                   for kind, text in messages)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title><style>{STYLE}</style></head>
<body><header><a href="#maincontent" class="skip">Skip to Content</a><ul class="links">{links}</ul>
<div class="top"><a class="logo" href="/" aria-label="store logo">{SITE_NAME}</a>
<form class="search" role="search" action="/catalogsearch/result/" method="get">
<label for="search">Search</label> <input id="search" type="search" name="q" value="{e(query)}"
 placeholder="Search entire store here..."> <button type="submit">Search</button></form>
<a href="/checkout/cart/" class="cart">My Cart ({cart_count} items)</a></div></header>
<nav class="categories" aria-label="Categories">{nav}</nav>
<main id="maincontent"><div class="content">{msgs}{body}</div></main>
<footer><a href="/contact/">Contact Us</a><a href="/sales/guest/form/">Orders and Returns</a>
<a href="/privacy-policy-cookie-restriction-mode/">Privacy and Cookie Policy</a>
<small>Copyright © 2013-present Magento, Inc. All rights reserved.</small></footer></body></html>"""


# catalog -------------------------------------------------------------------------------
def product_card(p) -> str:
    reviews = (f'<a href="/{e(p["slug"])}.html#reviews">{p["reviews"]} Reviews</a>'
               if p["reviews"] else "No reviews yet")
    return f"""<li class="item"><a href="/{e(p["slug"])}.html"><img src="/media/product/{p["id"]}.svg"
 alt="{e(p["name"])}" width="120" height="120"></a>
<div><a class="name" href="/{e(p["slug"])}.html">{e(p["name"])}</a></div>
<div class="rating">Rating: {stars(p["rating"])} {reviews}</div>
<div class="price">{money(p["price_cents"])}</div>
<form method="post" action="/checkout/cart/add/"><input type="hidden" name="product" value="{p["id"]}">
<button type="submit" title="Add to Cart">Add to Cart</button></form></li>"""


def home(featured: list, categories: list) -> tuple[str, str]:
    cats = "".join(f'<li><a href="/{e(c["path"])}.html">{e(c["name"])}</a></li>' for c in categories)
    grid = "".join(product_card(p) for p in featured)
    return SITE_NAME, f"""<h1>{SITE_NAME}</h1><p>One Stop Market: everything for home, work and play.</p>
<h2>Shop by Category</h2><ul>{cats}</ul><h2>Product Showcases</h2><ul class="grid">{grid}</ul>"""


def listing(title: str, heading: str, query: Query, rows: list, total: int, facets: dict, base_path: str,
            intro: str = "", path_args: dict | None = None) -> tuple[str, str]:
    path_args = path_args or {}

    page_cat = path_args.get("cat")

    def url(**change) -> str:
        args = {"q": query.q, "cat": query.category, "price": query.price, "rating": query.rating or "",
                "brand": query.brand, "product_list_order": query.order if query.order != "relevance" else "",
                "p": query.page if query.page > 1 else ""}
        args.update(change)
        base = base_path
        if page_cat is not None:  # on a category page the category is the path itself
            base = f"/{args.pop('cat', '') or page_cat}.html"
        clean = {k: v for k, v in args.items() if v not in ("", None, 0)}
        return base + ("?" + urlencode(clean) if clean else "")

    side = ['<aside aria-label="Shop By"><h2>Shop By</h2>']
    active = [(name, label) for name, label in (("q", ""), ("cat", query.category), ("price", query.price),
                                                  ("rating", query.rating and f"{query.rating} stars & up"),
                                                  ("brand", query.brand)) if label and name not in path_args]
    if active:
        side.append("<h3>Now Shopping by</h3><ul>")
        for name, label in active:
            side.append(f'<li>{e(name.title())}: {e(label)} <a href="{e(url(**{name: "", "p": ""}))}" '
                        f'aria-label="Remove filter {e(label)}">Remove</a></li>')
        side.append(f'</ul><a href="{e(url(cat="", price="", rating="", brand="", p=""))}">Clear All</a>')
    for key, label in (("category", "Category"), ("price", "Price"), ("brand", "Brand")):
        options = facets.get(key) or []
        if key == "category" and "cat" in path_args and len(options) <= 1:
            continue
        if not options:
            continue
        arg = "cat" if key == "category" else key
        items = "".join(f'<li><a href="{e(url(**{arg: v, "p": ""}))}">{e(lbl)}</a> <span>({n})</span></li>'
                        for v, lbl, n in options)
        side.append(f"<h3>{label}</h3><ul>{items}</ul>")
    ratings = "".join(f'<li><a href="{e(url(rating=r, p=""))}">{r} stars &amp; up</a></li>' for r in (4, 3, 2))
    side.append(f"<h3>Rating</h3><ul>{ratings}</ul></aside>")
    sorts = " | ".join(
        (f"<strong>{lbl}</strong>" if key == query.order
         else f'<a href="{e(url(product_list_order=key if key != "relevance" else "", p=""))}">{lbl}</a>')
        for key, (lbl, _) in SORTS.items())
    first = (query.page - 1) * PAGE_SIZE + 1
    last = min(total, query.page * PAGE_SIZE)
    pages = max(1, -(-total // PAGE_SIZE))
    pager = []
    if query.page > 1:
        pager.append(f'<a href="{e(url(p=query.page - 1))}">Previous</a>')
    for n in range(max(1, query.page - 3), min(pages, query.page + 3) + 1):
        pager.append(f"<strong>Page {n}</strong>" if n == query.page
                     else f'<a href="{e(url(p=n))}" aria-label="Page {n}">{n}</a>')
    if query.page < pages:
        pager.append(f'<a href="{e(url(p=query.page + 1))}">Next</a>')
    if rows:
        count = f"Items {first}-{last} of {total}"
        grid = f'<ul class="grid">{"".join(product_card(p) for p in rows)}</ul>'
    else:
        count = "0 items"
        grid = "<p>Your search returned no results.</p>"
    body = f"""<h1>{e(heading)}</h1>{intro}<p class="toolbar-amount">{count}</p>
<nav aria-label="Sort By">Sort By: {sorts}</nav>{grid}
<nav aria-label="Pages">{" ".join(pager) if pages > 1 else ""}</nav>"""
    return title, f'<div style="display:flex;gap:24px">{"".join(side)}<section style="flex:1">{body}</section></div>'


def product(p, category, parent, reviews: list, customer) -> tuple[str, str]:
    crumbs = (f'<nav aria-label="Breadcrumbs"><a href="/">Home</a> &gt; <a href="/{e(parent["path"])}.html">'
              f'{e(parent["name"])}</a> &gt; <a href="/{e(category["path"])}.html">{e(category["name"])}</a></nav>')
    stock = "In stock" if p["stock"] > 0 else "Out of stock"
    disabled = "" if p["stock"] > 0 else " disabled"
    revs = "".join(
        f"""<div class="review"><h3>{e(r["title"])}</h3><div>Rating: {r["rating"]} out of 5</div>
<p>{e(r["body"])}</p><div>Review by <strong class="nickname">{e(r["nickname"])}</strong></div>
<div>Posted on <time>{e(r["created"][:10])}</time></div></div>""" for r in reviews) or "<p>No reviews yet.</p>"
    nick = e(customer["first_name"]) if customer is not None else ""
    radios = "".join(f'<label><input type="radio" name="rating" value="{n}"{" required" if n == 1 else ""}> '
                     f'{n} star{"s" if n > 1 else ""}</label> ' for n in range(1, 6))
    summary = (f'Rating: {p["rating"]:.1f} out of 5 (<a href="#reviews">{p["reviews"]} Reviews</a>)'
               if p["reviews"] else "Be the first to review this product")
    return p["name"], f"""{crumbs}<h1>{e(p["name"])}</h1>
<div class="rating-summary">{summary}</div>
<div class="price">{money(p["price_cents"])}</div><div class="stock">{stock}</div>
<div class="sku">SKU: <span itemprop="sku">{e(p["sku"])}</span></div>
<img src="/media/product/{p["id"]}.svg" alt="{e(p["name"])}" width="240" height="240">
<form method="post" action="/checkout/cart/add/"><input type="hidden" name="product" value="{p["id"]}">
<label for="qty">Qty</label> <input id="qty" name="qty" type="number" min="1" value="1">
<button type="submit" id="product-addtocart-button"{disabled}>Add to Cart</button></form>
<form method="post" action="/wishlist/add/"><input type="hidden" name="product" value="{p["id"]}">
<button type="submit">Add to Wish List</button></form>
<section aria-label="Details"><h2>Details</h2><p class="description">{e(p["description"])}</p></section>
<section aria-label="More Information"><h2>More Information</h2><table><tbody>
<tr><th scope="row">Brand</th><td>{e(p["brand"])}</td></tr><tr><th scope="row">Color</th><td>{e(p["color"])}</td></tr>
<tr><th scope="row">SKU</th><td>{e(p["sku"])}</td></tr></tbody></table></section>
<section id="reviews" aria-label="Reviews"><h2>Customer Reviews ({p["reviews"]})</h2>{revs}</section>
<section aria-label="Write Your Own Review"><h2>Write Your Own Review</h2>
<p>You're reviewing: {e(p["name"])}</p>
<form method="post" action="/review/product/post/"><input type="hidden" name="product" value="{p["id"]}">
<fieldset><legend>Your Rating</legend>{radios}</fieldset>
<div><label for="nickname_field">Nickname</label> <input id="nickname_field" name="nickname" value="{nick}"
 required></div>
<div><label for="summary_field">Summary</label> <input id="summary_field" name="title" required></div>
<div><label for="review_field">Review</label> <textarea id="review_field" name="detail" rows="4" required>
</textarea></div>
<button type="submit">Submit Review</button></form></section>"""


# cart and checkout ---------------------------------------------------------------------
def cart(items: list) -> tuple[str, str]:
    if not items:
        return "Shopping Cart", ('<h1>Shopping Cart</h1><p>You have no items in your shopping cart.</p>'
                                 '<p>Click <a href="/">here</a> to continue shopping.</p>')
    rows = "".join(f"""<tr class="item"><td><a href="/{e(r["slug"])}.html">{e(r["name"])}</a></td>
<td>{money(r["price_cents"])}</td><td><input type="number" min="0" name="qty_{r["id"]}" value="{r["qty"]}"
 aria-label="Qty of {e(r["name"])}" class="qty"></td><td>{money(r["price_cents"] * r["qty"])}</td>
<td><button type="submit" name="remove" value="{r["id"]}" aria-label="Remove {e(r["name"])}">Remove item</button>
</td></tr>""" for r in items)
    subtotal = sum(r["price_cents"] * r["qty"] for r in items)
    return "Shopping Cart", f"""<h1>Shopping Cart</h1><form method="post" action="/checkout/cart/updatePost/">
<table id="shopping-cart-table"><thead><tr><th>Item</th><th>Price</th><th>Qty</th><th>Subtotal</th><th></th></tr>
</thead><tbody>{rows}</tbody></table><button type="submit" name="update_cart_action" value="update">Update Shopping
 Cart</button></form><section aria-label="Summary"><h2>Summary</h2><p>Subtotal: <span class="subtotal">
{money(subtotal)}</span></p><a href="/checkout/" class="checkout">Proceed to Checkout</a></section>"""


def checkout(items: list, customer, form: dict | None = None) -> tuple[str, str]:
    c = dict(customer) if customer is not None else {}
    form = form or {}

    def field(name: str, label: str, value: str) -> str:
        v = form.get(name, value)
        return (f'<div><label for="{name}">{label}</label> <input id="{name}" name="{name}" value="{e(v)}" '
                f'required></div>')

    fields = "".join([
        "" if customer is not None else field("email", "Email Address", ""),
        field("firstname", "First Name", c.get("first_name", "")),
        field("lastname", "Last Name", c.get("last_name", "")),
        field("street", "Street Address", c.get("street", "")),
        field("city", "City", c.get("city", "")),
        field("region", "State/Province", c.get("region", "")),
        field("postcode", "Zip/Postal Code", c.get("postcode", "")),
        field("country", "Country", c.get("country", "United States")),
        field("telephone", "Phone Number", c.get("phone", "")),
    ])
    methods = "".join(
        f'<div><label><input type="radio" name="shipping_method" value="{k}"{" checked" if k == "flatrate" else ""}>'
        f' {label} {money(cents)}</label></div>' for k, (label, cents) in
        (("flatrate", ("Flat Rate", 500)), ("express", ("Express Shipping", 1500)),
         ("freeshipping", ("Free Shipping", 0))))
    lines = "".join(f'<li>{e(r["name"])} × {r["qty"]}: {money(r["price_cents"] * r["qty"])}</li>' for r in items)
    subtotal = sum(r["price_cents"] * r["qty"] for r in items)
    return "Checkout", f"""<h1>Checkout</h1><form method="post" action="/checkout/place/">
<fieldset><legend>Shipping Address</legend>{fields}</fieldset>
<fieldset><legend>Shipping Methods</legend>{methods}</fieldset>
<fieldset><legend>Payment Method</legend><label><input type="radio" name="payment" value="checkmo" checked>
 Check / Money order</label></fieldset>
<section aria-label="Order Summary"><h2>Order Summary</h2><ul>{lines}</ul><p>Cart Subtotal: {money(subtotal)}</p>
</section><button type="submit">Place Order</button></form>"""


def success(order) -> tuple[str, str]:
    return "Success Page", f"""<h1>Thank you for your purchase!</h1>
<p>Your order number is: <a href="/sales/order/view/order_id/{order["id"]}/">{e(order["number"])}</a>.</p>
<p>We'll email you an order confirmation with details and tracking info.</p>
<a href="/">Continue Shopping</a>"""


# account -------------------------------------------------------------------------------
ACCOUNT_LINKS = [("/customer/account/", "My Account"), ("/sales/order/history/", "My Orders"),
                 ("/wishlist/", "My Wish List"), ("/customer/address/", "Address Book"),
                 ("/customer/account/edit/", "Account Information"), ("/review/customer/", "My Product Reviews"),
                 ("/newsletter/manage/", "Newsletter Subscriptions")]


def account_page(title: str, current: str, body: str) -> tuple[str, str]:
    links = "".join(f"<li><strong>{label}</strong></li>" if href == current else
                    f'<li><a href="{href}">{label}</a></li>' for href, label in ACCOUNT_LINKS)
    return title, (f'<div style="display:flex;gap:24px"><nav aria-label="Account" style="width:200px"><ul>{links}'
                   f'</ul></nav><section style="flex:1"><h1>{e(title)}</h1>{body}</section></div>')


def address_block(c) -> str:
    return (f'<address>{e(c["first_name"])} {e(c["last_name"])}<br>{e(c["street"])}<br>{e(c["city"])}, '
            f'{e(c["region"])}, {e(c["postcode"])}<br>{e(c["country"])}<br>T: {e(c["phone"])}</address>')


def dashboard(c) -> tuple[str, str]:
    news = "You are subscribed to \"General Subscription\"." if c["newsletter"] else \
        "You aren't subscribed to our newsletter."
    return account_page("My Account", "/customer/account/", f"""<h2>Account Information</h2>
<h3>Contact Information</h3><p>{e(c["first_name"])} {e(c["last_name"])}<br>{e(c["email"])}</p>
<a href="/customer/account/edit/">Edit</a><h3>Newsletters</h3><p>{news}</p>
<h2>Address Book</h2><h3>Default Shipping Address</h3>{address_block(c)}
<a href="/customer/address/edit/">Edit Address</a>""")


def account_edit(c) -> tuple[str, str]:
    return account_page("Edit Account Information", "/customer/account/edit/", f"""
<form method="post" action="/customer/account/editPost/"><fieldset><legend>Account Information</legend>
<div><label for="firstname">First Name</label> <input id="firstname" name="firstname" value="{e(c["first_name"])}"
 required></div><div><label for="lastname">Last Name</label> <input id="lastname" name="lastname"
 value="{e(c["last_name"])}" required></div><div><label for="email">Email</label> <input id="email" name="email"
 type="email" value="{e(c["email"])}" required></div></fieldset><button type="submit">Save</button></form>""")


def address(c) -> tuple[str, str]:
    return account_page("Address Book", "/customer/address/", f"""<h2>Default Addresses</h2>
<h3>Default Billing Address</h3>{address_block(c)}<h3>Default Shipping Address</h3>{address_block(c)}
<a href="/customer/address/edit/">Change Shipping Address</a>""")


def address_edit(c) -> tuple[str, str]:
    def field(name: str, label: str, value: str) -> str:
        return f'<div><label for="{name}">{label}</label> <input id="{name}" name="{name}" value="{e(value)}"></div>'

    return account_page("Edit Address", "/customer/address/", f"""
<form method="post" action="/customer/address/formPost/">
<fieldset><legend>Contact Information</legend>{field("telephone", "Phone Number", c["phone"])}</fieldset>
<fieldset><legend>Address</legend>{field("street", "Street Address", c["street"])}{field("city", "City", c["city"])}
{field("region", "State/Province", c["region"])}{field("postcode", "Zip/Postal Code", c["postcode"])}
{field("country", "Country", c["country"])}</fieldset><button type="submit">Save Address</button></form>""")


def newsletter(c) -> tuple[str, str]:
    checked = " checked" if c["newsletter"] else ""
    return account_page("Newsletter Subscription", "/newsletter/manage/", f"""
<form method="post" action="/newsletter/manage/save/"><fieldset><legend>Subscription option</legend>
<label><input type="checkbox" id="subscription" name="is_subscribed" value="1"{checked}> General Subscription</label>
</fieldset><button type="submit">Save</button></form>""")


def orders(rows: list, total: int, page: int) -> tuple[str, str]:
    if not rows:
        return account_page("My Orders", "/sales/order/history/", "<p>You have placed no orders.</p>")
    body = "".join(f"""<tr><td><a href="/sales/order/view/order_id/{o["id"]}/">{e(o["number"])}</a></td>
<td>{e(_date(o["created"]))}</td><td>{e(o["ship_name"])}</td><td>{money(o["total_cents"])}</td>
<td>{e(o["status"].title())}</td><td><a href="/sales/order/view/order_id/{o["id"]}/">View Order</a>
<a href="/sales/order/reorder/order_id/{o["id"]}/">Reorder</a></td></tr>""" for o in rows)
    pages = -(-total // ORDERS_PAGE)
    pager = " ".join(f"<strong>Page {n}</strong>" if n == page else
                     f'<a href="/sales/order/history/?p={n}" aria-label="Page {n}">{n}</a>'
                     for n in range(1, pages + 1))
    first, last = (page - 1) * ORDERS_PAGE + 1, min(total, page * ORDERS_PAGE)
    return account_page("My Orders", "/sales/order/history/", f"""<table id="my-orders-table">
<caption>Orders</caption><thead><tr><th>Order #</th><th>Date</th><th>Ship To</th><th>Order Total</th><th>Status</th>
<th>Action</th></tr></thead><tbody>{body}</tbody></table><p>Items {first} to {last} of {total} total</p>
<nav aria-label="Pages">{pager}</nav>""")


def order_view(o, items: list) -> tuple[str, str]:
    rows = "".join(f"""<tr><td>{e(i["name"])}</td><td>{e(i["sku"])}</td><td>{money(i["price_cents"])}</td>
<td>Ordered: {i["qty"]}</td><td>{money(i["price_cents"] * i["qty"])}</td></tr>""" for i in items)
    return account_page(f"Order # {o['number']}", "/sales/order/history/", f"""
<p class="order-status">Status: {e(o["status"].title())}</p>
<p class="order-date">Order Date: {e(_date(o["created"]))}</p>
<a href="/sales/order/reorder/order_id/{o["id"]}/">Reorder</a>
<h2>Items Ordered</h2><table class="items"><thead><tr><th>Product Name</th><th>SKU</th><th>Price</th><th>Qty</th>
<th>Subtotal</th></tr></thead><tbody>{rows}</tbody><tfoot>
<tr><th scope="row" colspan="4">Subtotal</th><td>{money(o["subtotal_cents"])}</td></tr>
<tr><th scope="row" colspan="4">Shipping &amp; Handling</th><td>{money(o["shipping_cents"])}</td></tr>
<tr><th scope="row" colspan="4">Grand Total</th><td class="grand-total">{money(o["total_cents"])}</td></tr></tfoot>
</table><h2>Order Information</h2><h3>Shipping Address</h3><address>{e(o["ship_name"])}<br>{e(o["ship_street"])}<br>
{e(o["ship_city"])}, {e(o["ship_region"])}, {e(o["ship_postcode"])}<br>{e(o["ship_country"])}</address>
<h3>Shipping Method</h3><p>{e(o["shipping_method"])}</p><h3>Payment Method</h3><p>{e(o["payment_method"])}</p>""")


def wishlist(items: list) -> tuple[str, str]:
    if not items:
        return account_page("My Wish List", "/wishlist/", "<p>You have no items in your wish list.</p>")
    rows = "".join(f"""<li class="item"><a href="/{e(p["slug"])}.html">{e(p["name"])}</a>
<span class="price">{money(p["price_cents"])}</span>
<form method="post" action="/wishlist/cart/"><input type="hidden" name="product" value="{p["id"]}">
<button type="submit" aria-label="Add {e(p["name"])} to Cart">Add to Cart</button></form>
<form method="post" action="/wishlist/remove/"><input type="hidden" name="product" value="{p["id"]}">
<button type="submit" aria-label="Remove {e(p["name"])}">Remove item</button></form></li>""" for p in items)
    return account_page("My Wish List", "/wishlist/", f'<ul class="wishlist">{rows}</ul>')


def my_reviews(rows: list) -> tuple[str, str]:
    if not rows:
        return account_page("My Product Reviews", "/review/customer/", "<p>You have submitted no reviews.</p>")
    body = "".join(f"""<tr><td>{e(r["created"][:10])}</td><td><a href="/{e(r["slug"])}.html">{e(r["product_name"])}</a>
</td><td>{r["rating"]} out of 5</td><td>{e(r["title"])}: {e(r["body"])}</td></tr>""" for r in rows)
    return account_page("My Product Reviews", "/review/customer/", f"""<table><thead><tr><th>Created</th>
<th>Product Name</th><th>Rating</th><th>Review</th></tr></thead><tbody>{body}</tbody></table>""")


def login(email: str = "", referer: str = "") -> tuple[str, str]:
    return "Customer Login", f"""<h1>Customer Login</h1><section aria-label="Registered Customers">
<h2>Registered Customers</h2><p>If you have an account, sign in with your email address.</p>
<form method="post" action="/customer/account/loginPost/"><input type="hidden" name="referer" value="{e(referer)}">
<div><label for="email">Email</label> <input id="email" name="login[username]" type="email" value="{e(email)}"
 required></div><div><label for="pass">Password</label> <input id="pass" name="login[password]" type="password"
 required></div><button type="submit" id="send2">Sign In</button></form></section>
<section aria-label="New Customers"><h2>New Customers</h2><p>Creating an account has many benefits.</p>
<a href="/customer/account/create/">Create an Account</a></section>"""


def create_account() -> tuple[str, str]:
    return "Create New Customer Account", """<h1>Create New Customer Account</h1>
<form method="post" action="/customer/account/createpost/"><fieldset><legend>Personal Information</legend>
<div><label for="firstname">First Name</label> <input id="firstname" name="firstname" required></div>
<div><label for="lastname">Last Name</label> <input id="lastname" name="lastname" required></div></fieldset>
<fieldset><legend>Sign-in Information</legend>
<div><label for="email_address">Email</label> <input id="email_address" name="email" type="email" required></div>
<div><label for="password">Password</label> <input id="password" name="password" type="password" required></div>
<div><label for="password-confirmation">Confirm Password</label> <input id="password-confirmation"
 name="password_confirmation" type="password" required></div></fieldset>
<button type="submit">Create an Account</button></form>"""


def contact(c, sent: bool) -> tuple[str, str]:
    name = f'{c["first_name"]} {c["last_name"]}' if c is not None else ""
    email = c["email"] if c is not None else ""
    done = ('<div role="alert" class="msg">Thanks for contacting us with your comments and questions. '
            "We'll respond to you very soon.</div>") if sent else ""
    return "Contact Us", f"""<h1>Contact Us</h1>{done}
<form method="post" action="/contact/index/post/" id="contact-form">
<fieldset><legend>Write Us</legend><p>Jot us a note and we'll get back to you as quickly as possible.</p>
<div><label for="name">Name</label> <input id="name" name="name" title="Name" value="{e(name)}" required></div>
<div><label for="email">Email</label> <input id="email" name="email" title="Email" type="email" value="{e(email)}"
 required></div><div><label for="telephone">Phone Number</label> <input id="telephone" name="telephone"
 title="Phone Number"></div><div><label for="comment">What’s on your mind?</label> <textarea id="comment"
 name="comment" title="What’s on your mind?" rows="5" required></textarea></div></fieldset>
<button type="submit" title="Submit">Submit</button></form>"""


def message_page(title: str, text: str) -> tuple[str, str]:
    return title, f"<h1>{e(title)}</h1><p>{e(text)}</p>"


def _date(created: str) -> str:
    """``2023-03-05 10:00:00`` -> ``3/5/23`` (Magento's short date)."""
    y, m, d = created[:10].split("-")
    return f"{int(m)}/{int(d)}/{y[2:]}"
