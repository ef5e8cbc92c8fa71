"""One Stop Market: the shopping site of Bunshin-WebArena-v0 (standard library only).

    python3 server.py --db /var/lib/shop/shop.db --port 7770

URLs follow Magento's (the shop WebArena uses): ``/<product>.html``, ``/<category>.html``,
``/catalogsearch/result/?q=``, ``/checkout/cart/``, ``/sales/order/history/``,
``/customer/account/login/``, ``/contact/``. Sessions are a cookie (``shop_session``)
naming a row of the ``sessions`` table; a signed-in customer's cart is kept per customer,
a guest's per session.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import traceback
from http import cookies
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pages  # noqa: E402
from store import Query, Store  # noqa: E402

COOKIE = "shop_session"
DB_PATH = "shop.db"


class Redirect(Exception):
    def __init__(self, location: str):
        self.location = location


class NotFound(Exception):
    pass


class Request:
    """One request's context: the store, the session, the customer, flash messages."""

    def __init__(self, handler: Handler, store: Store, method: str):
        self.h = handler
        self.store = store
        self.method = method
        parts = urlsplit(handler.path)
        self.path = parts.path
        self.args = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.form: dict[str, str] = {}
        if method == "POST":
            n = int(handler.headers.get("Content-Length") or 0)
            raw = handler.rfile.read(n).decode("utf-8", "replace") if n else ""
            self.form = {k: v[-1] for k, v in parse_qs(raw, keep_blank_values=True).items()}
        jar = cookies.SimpleCookie(handler.headers.get("Cookie") or "")
        self.token = jar[COOKIE].value if COOKIE in jar else ""
        self.session = store.session(self.token)
        if self.session is None:
            self.token = ""
        self.customer = store.customer(self.session["customer_id"]) if self.session and \
            self.session["customer_id"] else None
        self.set_cookie: str | None = None
        self.messages: list[tuple[str, str]] = _pop_flash(self)

    @property
    def cart_owner(self) -> str:
        if self.customer is not None:
            return f"customer:{self.customer['id']}"
        return f"session:{self.ensure_session()}"

    def ensure_session(self) -> str:
        if not self.token:
            self.token = self.store.new_session(None)
            self.set_cookie = self.token
        return self.token

    def flash(self, text: str, kind: str = "success") -> None:
        _FLASH.setdefault(self.ensure_session(), []).append((kind, text))

    def require_login(self) -> None:
        if self.customer is None:
            self.flash("Please sign in to continue.", "error")
            raise Redirect("/customer/account/login/?referer=" + quote(self.h.path))


_FLASH: dict[str, list[tuple[str, str]]] = {}


def _pop_flash(req: Request) -> list[tuple[str, str]]:
    return _FLASH.pop(req.token, []) if req.token else []


# routes ------------------------------------------------------------------------------------
ROUTES: list[tuple[str, str, object]] = []


def route(method: str, pattern: str):
    def deco(fn):
        ROUTES.append((method, pattern, fn))
        return fn
    return deco


@route("GET", r"/")
def home(req: Request):
    rows = [req.store.product_by_id(pid) for pid in (7, 130, 301, 455, 620, 777, 951, 1203)]
    return pages.home([r for r in rows if r is not None], req.store.top_categories())


@route("GET", r"/catalogsearch/result/?")
def search(req: Request):
    query = _query(req)
    rows, total = req.store.search(query)
    heading = f"Search results for: '{query.q}'" if query.q else "All Products"
    return pages.listing(heading, heading, query, rows, total, req.store.facets(query), "/catalogsearch/result/")


@route("GET", r"/(?P<slug>[a-z0-9-]+(?:/[a-z0-9-]+)?)\.html")
def category_or_product(req: Request, slug: str):
    cat = req.store.category(slug)
    if cat is not None:
        query = _query(req)
        query.category = cat["path"]
        rows, total = req.store.search(query)
        subs = req.store.subcategories(cat["id"])
        intro = ("<ul>" + "".join(f'<li><a href="/{pages.e(s["path"])}.html">{pages.e(s["name"])}</a></li>'
                                  for s in subs) + "</ul>") if subs else ""
        return pages.listing(cat["name"], cat["name"], query, rows, total, req.store.facets(query),
                             f"/{cat['path']}.html", intro, {"cat": cat["path"]})
    p = req.store.product(slug)
    if p is None:
        raise NotFound()
    sub = req.store.category_by_id(p["category_id"])
    parent = req.store.category_by_id(sub["parent_id"])
    return pages.product(p, sub, parent, req.store.reviews(p["id"]), req.customer)


@route("GET", r"/media/product/(?P<pid>\d+)\.svg")
def product_image(req: Request, pid: str):
    hue = int(hashlib.md5(pid.encode()).hexdigest()[:4], 16) % 360
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="120" height="120"><rect width="120" height="120" '
           f'fill="hsl({hue},55%,75%)"/><text x="60" y="66" font-size="20" text-anchor="middle">#{pid}</text></svg>')
    return ("image/svg+xml", svg.encode())


@route("POST", r"/checkout/cart/add/?")
def cart_add(req: Request):
    p = req.store.product_by_id(_int(req.form.get("product"), 0))
    if p is None:
        raise NotFound()
    qty = max(1, _int(req.form.get("qty"), 1))
    if p["stock"] <= 0:
        req.flash(f"{p['name']} is out of stock.", "error")
        raise Redirect(f"/{p['slug']}.html")
    req.store.add_to_cart(req.cart_owner, p["id"], qty)
    req.flash(f"You added {p['name']} to your shopping cart.")
    raise Redirect(f"/{p['slug']}.html")


@route("GET", r"/checkout/cart/?")
def cart(req: Request):
    return pages.cart(req.store.cart(req.cart_owner))


@route("POST", r"/checkout/cart/updatePost/?")
def cart_update(req: Request):
    owner = req.cart_owner
    if req.form.get("remove"):
        req.store.remove_from_cart(owner, _int(req.form["remove"], 0))
        req.flash("The item was removed from your shopping cart.")
    else:
        for key, value in req.form.items():
            if key.startswith("qty_"):
                req.store.set_cart_qty(owner, _int(key[4:], 0), _int(value, 1))
        req.flash("Your shopping cart was updated.")
    raise Redirect("/checkout/cart/")


@route("GET", r"/checkout/?")
def checkout(req: Request):
    items = req.store.cart(req.cart_owner)
    if not items:
        raise Redirect("/checkout/cart/")
    return pages.checkout(items, req.customer)


@route("POST", r"/checkout/place/?")
def place_order(req: Request):
    f = req.form
    missing = [k for k in ("firstname", "lastname", "street", "city", "region", "postcode", "country") if not
               f.get(k, "").strip()]
    if missing:
        req.flash("Please fill in: " + ", ".join(missing), "error")
        raise Redirect("/checkout/")
    if req.customer is None:
        req.flash("Please sign in to place an order.", "error")
        raise Redirect("/customer/account/login/?referer=/checkout/")
    try:
        order = req.store.place_order(req.customer["id"], req.cart_owner, {k: f.get(k, "").strip() for k in f},
                                      f.get("shipping_method", "flatrate"))
    except ValueError as err:
        req.flash(str(err), "error")
        raise Redirect("/checkout/cart/") from None
    raise Redirect(f"/checkout/onepage/success/?order={order['id']}")


@route("GET", r"/checkout/onepage/success/?")
def success(req: Request):
    req.require_login()
    order = req.store.order(_int(req.args.get("order"), 0))
    if order is None or order["customer_id"] != req.customer["id"]:
        raise NotFound()
    return pages.success(order)


@route("GET", r"/customer/account/?")
def account(req: Request):
    req.require_login()
    return pages.dashboard(req.customer)


@route("GET", r"/customer/account/edit/?")
def account_edit(req: Request):
    req.require_login()
    return pages.account_edit(req.customer)


@route("POST", r"/customer/account/editPost/?")
def account_edit_post(req: Request):
    req.require_login()
    f = req.form
    first, last, email = (f.get(k, "").strip() for k in ("firstname", "lastname", "email"))
    if not (first and last and email):
        req.flash("Please fill in every field.", "error")
        raise Redirect("/customer/account/edit/")
    req.store.db.execute("UPDATE customers SET first_name = ?, last_name = ?, email = ? WHERE id = ?",
                         (first, last, email, req.customer["id"]))
    req.flash("You saved the account information.")
    raise Redirect("/customer/account/")


@route("GET", r"/customer/address/?")
def address(req: Request):
    req.require_login()
    return pages.address(req.customer)


@route("GET", r"/customer/address/edit/?")
def address_edit(req: Request):
    req.require_login()
    return pages.address_edit(req.customer)


@route("POST", r"/customer/address/formPost/?")
def address_post(req: Request):
    req.require_login()
    f = req.form
    req.store.db.execute(
        "UPDATE customers SET phone = ?, street = ?, city = ?, region = ?, postcode = ?, country = ? WHERE id = ?",
        (*(f.get(k, "").strip() for k in ("telephone", "street", "city", "region", "postcode", "country")),
         req.customer["id"]))
    req.flash("You saved the address.")
    raise Redirect("/customer/address/")


@route("GET", r"/newsletter/manage/?")
def newsletter(req: Request):
    req.require_login()
    return pages.newsletter(req.customer)


@route("POST", r"/newsletter/manage/save/?")
def newsletter_save(req: Request):
    req.require_login()
    on = 1 if req.form.get("is_subscribed") else 0
    req.store.db.execute("UPDATE customers SET newsletter = ? WHERE id = ?", (on, req.customer["id"]))
    req.flash("We have saved your subscription." if on else "We have removed your newsletter subscription.")
    raise Redirect("/customer/account/")


@route("GET", r"/sales/order/history/?")
def order_history(req: Request):
    req.require_login()
    page = max(1, _int(req.args.get("p"), 1))
    rows, total = req.store.orders(req.customer["id"], page)
    return pages.orders(rows, total, page)


def _own_order(req: Request, oid: str):
    req.require_login()
    order = req.store.order(int(oid))
    if order is None or order["customer_id"] != req.customer["id"]:
        raise NotFound()
    return order


@route("GET", r"/sales/order/view/order_id/(?P<oid>\d+)/?")
def order_view(req: Request, oid: str):
    order = _own_order(req, oid)
    return pages.order_view(order, req.store.order_items(order["id"]))


@route("GET", r"/sales/order/reorder/order_id/(?P<oid>\d+)/?")
def reorder(req: Request, oid: str):
    order = _own_order(req, oid)
    for item in req.store.order_items(order["id"]):
        req.store.add_to_cart(req.cart_owner, item["product_id"], item["qty"])
    req.flash(f"The items of order # {order['number']} were added to your shopping cart.")
    raise Redirect("/checkout/cart/")


@route("GET", r"/wishlist/?")
def wishlist(req: Request):
    req.require_login()
    return pages.wishlist(req.store.wishlist(req.customer["id"]))


@route("POST", r"/wishlist/(?P<what>add|remove|cart)/?")
def wishlist_post(req: Request, what: str):
    req.require_login()
    p = req.store.product_by_id(_int(req.form.get("product"), 0))
    if p is None:
        raise NotFound()
    cid = req.customer["id"]
    if what == "add":
        req.store.add_to_wishlist(cid, p["id"])
        req.flash(f"{p['name']} has been added to your Wish List.")
    elif what == "remove":
        req.store.remove_from_wishlist(cid, p["id"])
        req.flash(f"{p['name']} has been removed from your Wish List.")
    else:
        req.store.add_to_cart(req.cart_owner, p["id"], 1)
        req.store.remove_from_wishlist(cid, p["id"])
        req.flash(f"You added {p['name']} to your shopping cart.")
    raise Redirect("/wishlist/")


@route("POST", r"/review/product/post/?")
def review_post(req: Request):
    p = req.store.product_by_id(_int(req.form.get("product"), 0))
    if p is None:
        raise NotFound()
    f = req.form
    rating = _int(f.get("rating"), 0)
    nickname, title, detail = (f.get(k, "").strip() for k in ("nickname", "title", "detail"))
    if not (1 <= rating <= 5 and nickname and title and detail):
        req.flash("Please select a rating and fill in the nickname, summary and review.", "error")
        raise Redirect(f"/{p['slug']}.html")
    req.store.add_review(p["id"], req.customer["id"] if req.customer else None, nickname, rating, title, detail)
    req.flash("You submitted your review.")
    raise Redirect(f"/{p['slug']}.html")


@route("GET", r"/review/customer/?")
def my_reviews(req: Request):
    req.require_login()
    return pages.my_reviews(req.store.customer_reviews(req.customer["id"]))


@route("GET", r"/customer/account/login/?")
def login(req: Request):
    if req.customer is not None:
        raise Redirect("/customer/account/")
    return pages.login(referer=req.args.get("referer", ""))


@route("POST", r"/customer/account/loginPost/?")
def login_post(req: Request):
    c = req.store.login(req.form.get("login[username]", ""), req.form.get("login[password]", ""))
    if c is None:
        req.flash("The account sign-in was incorrect or your account is disabled temporarily. "
                  "Please wait and try again later.", "error")
        raise Redirect("/customer/account/login/")
    guest_cart = f"session:{req.token}" if req.token else None
    token = req.ensure_session()
    req.store.set_session_customer(token, c["id"])
    if guest_cart:
        req.store.merge_cart(guest_cart, f"customer:{c['id']}")
    referer = req.form.get("referer", "")
    raise Redirect(referer if referer.startswith("/") and not referer.startswith("//") else "/customer/account/")


@route("GET", r"/customer/account/logout/?")
def logout(req: Request):
    if req.token:
        req.store.drop_session(req.token)
        req.token = ""
        req.set_cookie = ""
    return pages.message_page("You are signed out", "You have signed out and will go to our homepage.")


@route("GET", r"/customer/account/create/?")
def create(req: Request):
    return pages.create_account()


@route("POST", r"/customer/account/createpost/?")
def create_post(req: Request):
    f = req.form
    first, last, email, pw = (f.get(k, "").strip() for k in ("firstname", "lastname", "email", "password"))
    if not (first and last and email and pw) or pw != f.get("password_confirmation", "").strip():
        req.flash("Please fill in every field; the passwords must match.", "error")
        raise Redirect("/customer/account/create/")
    if req.store.db.execute("SELECT 1 FROM customers WHERE lower(email) = lower(?)", (email,)).fetchone():
        req.flash("There is already an account with this email address.", "error")
        raise Redirect("/customer/account/create/")
    cid = req.store.create_customer(first, last, email, pw)
    req.store.set_session_customer(req.ensure_session(), cid)
    req.flash(f"Thank you for registering with {pages.SITE_NAME}.")
    raise Redirect("/customer/account/")


@route("GET", r"/contact/?")
def contact(req: Request):
    return pages.contact(req.customer, req.args.get("sent") == "1")


@route("POST", r"/contact/index/post/?")
def contact_post(req: Request):
    f = req.form
    name, email, phone, comment = (f.get(k, "").strip() for k in ("name", "email", "telephone", "comment"))
    if not (name and email and comment):
        req.flash("Please fill in your name, email and comment.", "error")
        raise Redirect("/contact/")
    req.store.add_message(name, email, phone, comment)
    raise Redirect("/contact/?sent=1")


@route("GET", r"/(?:privacy-policy-cookie-restriction-mode|sales/guest/form)/?")
def static_page(req: Request):
    if "privacy" in req.path:
        return pages.message_page("Privacy and Cookie Policy", "We only keep what an order needs.")
    return pages.message_page("Orders and Returns", "Sign in to see your orders, or contact us for a return.")


# HTTP ----------------------------------------------------------------------------------
def _query(req: Request) -> Query:
    return Query(q=req.args.get("q", "").strip(), category=req.args.get("cat", ""), price=req.args.get("price", ""),
                 rating=_int(req.args.get("rating"), 0), brand=req.args.get("brand", ""),
                 order=req.args.get("product_list_order", "relevance") or "relevance",
                 page=max(1, _int(req.args.get("p"), 1)))


def _int(value, default: int) -> int:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return default


COMPILED = [(m, re.compile(p + "$"), fn) for m, p, fn in ROUTES]


class Handler(BaseHTTPRequestHandler):
    server_version = "OneStopMarket/1.0"

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        store = Store(DB_PATH)
        try:
            req = Request(self, store, method)
            status, ctype, body, location = 200, "text/html; charset=utf-8", b"", None
            try:
                for m, pattern, fn in COMPILED:
                    match = pattern.match(req.path)
                    if m == method and match:
                        result = fn(req, **match.groupdict())
                        break
                else:
                    raise NotFound()
                if isinstance(result, tuple) and isinstance(result[1], bytes):
                    ctype, body = result
                else:
                    body = self._page(req, *result)
                store.commit()
            except Redirect as r:
                store.commit()
                status, location = 302, r.location
            except NotFound:
                status = 404
                body = self._page(req, "404 Not Found", "<h1>Whoops, our bad...</h1>"
                                  "<p>The page you requested was not found.</p>")
            except Exception:  # noqa: BLE001 - a bug in one page must not drop the connection
                traceback.print_exc()
                status = 500
                body = b"<!DOCTYPE html><title>Error</title><h1>There has been an error processing your request</h1>"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            if location:
                self.send_header("Location", location)
            if req.set_cookie is not None:
                value = req.set_cookie
                self.send_header("Set-Cookie", f"{COOKIE}={value}; Path=/; HttpOnly; SameSite=Lax"
                                 + ("" if value else "; Max-Age=0"))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)
        finally:
            store.close()

    def _page(self, req: Request, title: str, body: str) -> bytes:
        return pages.layout(title, body, customer=req.customer, cart_count=req.store.cart_count(
            f"customer:{req.customer['id']}" if req.customer else f"session:{req.token}"),
            categories=req.store.top_categories(), messages=req.messages,
            query=req.args.get("q", "") if req.path.startswith("/catalogsearch") else "").encode()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        if os.environ.get("SHOP_ACCESS_LOG"):
            super().log_message(format, *args)


def main() -> None:
    global DB_PATH
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default="/var/lib/shop/shop.db")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7770)
    args = ap.parse_args()
    DB_PATH = args.db
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"One Stop Market on http://{args.host}:{args.port} (db {DB_PATH})", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
