"""The shop's data access: catalog queries, sessions, carts, wish lists, orders, reviews.

Every request opens its own SQLite connection (``Store(path)``) and closes it at the end,
so the server holds no database file open between requests.
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import time
from dataclasses import dataclass

from catalog import SHIPPING, password_hash

PAGE_SIZE = 12
ORDERS_PAGE = 10
SORTS = {
    "relevance": ("Relevance", None),
    "name": ("Product Name", "p.name COLLATE NOCASE ASC"),
    "price_asc": ("Price: Low to High", "p.price_cents ASC, p.id ASC"),
    "price_desc": ("Price: High to Low", "p.price_cents DESC, p.id ASC"),
    "rating": ("Top Rated", "rating DESC, reviews DESC, p.id ASC"),
}


def money(cents: int) -> str:
    return f"${cents / 100:,.2f}"


@dataclass
class Query:
    """A catalog listing: search text, filters, sort and page (all from the URL)."""

    q: str = ""
    category: str = ""     # category path, e.g. "electronics/headphones"
    price: str = ""        # "10-20" dollars, upper bound exclusive; "100-" open
    rating: int = 0        # minimum average rating
    brand: str = ""
    order: str = "relevance"
    page: int = 1


class Store:
    def __init__(self, path: str):
        self.db = sqlite3.connect(path, timeout=20)
        self.db.row_factory = sqlite3.Row

    def close(self) -> None:
        self.db.close()

    def commit(self) -> None:
        self.db.commit()

    # catalog ---------------------------------------------------------------------------
    def top_categories(self) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM categories WHERE parent_id IS NULL ORDER BY id").fetchall()

    def category(self, path: str) -> sqlite3.Row | None:
        return self.db.execute("SELECT * FROM categories WHERE path = ?", (path,)).fetchone()

    def category_by_id(self, cid: int) -> sqlite3.Row | None:
        return self.db.execute("SELECT * FROM categories WHERE id = ?", (cid,)).fetchone()

    def subcategories(self, cid: int) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM categories WHERE parent_id = ? ORDER BY id", (cid,)).fetchall()

    def product(self, slug: str) -> sqlite3.Row | None:
        return self.db.execute(_PRODUCT_SQL + " WHERE p.slug = ? GROUP BY p.id", (slug,)).fetchone()

    def product_by_id(self, pid: int) -> sqlite3.Row | None:
        return self.db.execute(_PRODUCT_SQL + " WHERE p.id = ? GROUP BY p.id", (pid,)).fetchone()

    def reviews(self, pid: int) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM reviews WHERE product_id = ? ORDER BY created DESC, id DESC",
                               (pid,)).fetchall()

    def _where(self, query: Query, skip: str = "") -> tuple[str, list]:
        where, args = [], []
        for word in query.q.lower().split():
            where.append("(lower(p.name) LIKE ? OR lower(p.description) LIKE ? OR lower(c.name) LIKE ?)")
            args += [f"%{word}%"] * 3
        if query.category and skip != "category":
            where.append("(c.path = ? OR c.path LIKE ?)")
            args += [query.category, query.category + "/%"]
        if query.price and skip != "price":
            lo, _, hi = query.price.partition("-")
            if lo.strip().replace(".", "", 1).isdigit():
                where.append("p.price_cents >= ?")
                args.append(round(float(lo) * 100))
            if hi.strip().replace(".", "", 1).isdigit():
                where.append("p.price_cents < ?")
                args.append(round(float(hi) * 100))
        if query.brand and skip != "brand":
            where.append("p.brand = ?")
            args.append(query.brand)
        return (" WHERE " + " AND ".join(where)) if where else "", args

    def search(self, query: Query) -> tuple[list[sqlite3.Row], int]:
        """One page of products and the total count."""
        where, args = self._where(query)
        having = f" HAVING rating >= {int(query.rating)}" if query.rating else ""
        base = (_PRODUCT_SQL.replace("FROM products p", "FROM products p JOIN categories c ON c.id = p.category_id")
                + where + " GROUP BY p.id" + having)
        total = self.db.execute(f"SELECT count(*) FROM ({base})", args).fetchone()[0]
        order = SORTS.get(query.order, SORTS["relevance"])[1]
        if order is None:  # relevance: name matches first, then by id
            words = query.q.lower().split()
            order = "p.id ASC"
            if words:
                score = " + ".join(["(lower(p.name) LIKE ?)"] * len(words))
                order = f"({score}) DESC, p.id ASC"
                args = args + [f"%{w}%" for w in words]
        rows = self.db.execute(f"{base} ORDER BY {order} LIMIT ? OFFSET ?",
                               [*args, PAGE_SIZE, (max(1, query.page) - 1) * PAGE_SIZE]).fetchall()
        return rows, total

    def facets(self, query: Query) -> dict[str, list[tuple[str, str, int]]]:
        """Counts for the filter sidebar: categories, price ranges, brands (value, label, count)."""
        join = "FROM products p JOIN categories c ON c.id = p.category_id"
        where, args = self._where(query, skip="category")
        if query.category:
            cat = self.category(query.category)
            level = "c.path" if cat and cat["parent_id"] else "substr(c.path, 1, instr(c.path || '/', '/') - 1)"
            if cat and cat["parent_id"] is None:
                level = "c.path"
                where += (" AND " if where else " WHERE ") + "c.parent_id = ?"
                args = [*args, cat["id"]]
        else:
            level = "substr(c.path, 1, instr(c.path || '/', '/') - 1)"
        cats = self.db.execute(f"SELECT {level} AS v, count(*) AS n {join}{where} GROUP BY v ORDER BY v", args)
        names = {r["path"]: r["name"] for r in self.db.execute("SELECT path, name FROM categories")}
        out: dict[str, list] = {"category": [(r["v"], names.get(r["v"], r["v"]), r["n"]) for r in cats]}
        where, args = self._where(query, skip="price")
        prices = [r[0] for r in self.db.execute(f"SELECT p.price_cents {join}{where}", args)]
        out["price"] = _price_buckets(prices)
        where, args = self._where(query, skip="brand")
        out["brand"] = [(r["brand"], r["brand"], r["n"]) for r in self.db.execute(
            f"SELECT p.brand, count(*) AS n {join}{where} GROUP BY p.brand ORDER BY n DESC, p.brand LIMIT 12", args)]
        return out

    # customers and sessions ------------------------------------------------------------
    def customer(self, cid: int) -> sqlite3.Row | None:
        return self.db.execute("SELECT * FROM customers WHERE id = ?", (cid,)).fetchone()

    def login(self, email: str, password: str) -> sqlite3.Row | None:
        row = self.db.execute("SELECT * FROM customers WHERE lower(email) = lower(?)", (email.strip(),)).fetchone()
        if row is None:
            return None
        salt = row["password_hash"].split("$", 1)[0]
        return row if secrets.compare_digest(password_hash(password, salt), row["password_hash"]) else None

    def create_customer(self, first: str, last: str, email: str, password: str) -> int:
        salt = "s" + hashlib.sha256(email.encode()).hexdigest()[:8]
        cur = self.db.execute(
            "INSERT INTO customers (email, password_hash, first_name, last_name, phone, street, city, region, "
            "postcode, country, created) VALUES (?, ?, ?, ?, '', '', '', '', '', 'United States', ?)",
            (email.strip(), password_hash(password, salt), first.strip(), last.strip(), _now()))
        return cur.lastrowid

    def session(self, token: str) -> sqlite3.Row | None:
        return self.db.execute("SELECT * FROM sessions WHERE token = ?", (token,)).fetchone() if token else None

    def new_session(self, customer_id: int | None) -> str:
        token = secrets.token_hex(16)
        self.db.execute("INSERT INTO sessions (token, customer_id, created) VALUES (?, ?, ?)",
                        (token, customer_id, _now()))
        return token

    def set_session_customer(self, token: str, customer_id: int | None) -> None:
        self.db.execute("UPDATE sessions SET customer_id = ? WHERE token = ?", (customer_id, token))

    def drop_session(self, token: str) -> None:
        self.db.execute("DELETE FROM sessions WHERE token = ?", (token,))

    # cart ------------------------------------------------------------------------------
    def cart(self, owner: str) -> list[sqlite3.Row]:
        return self.db.execute(
            "SELECT ci.qty, p.* FROM cart_items ci JOIN products p ON p.id = ci.product_id WHERE ci.owner = ? "
            "ORDER BY ci.id", (owner,)).fetchall()

    def cart_count(self, owner: str) -> int:
        return self.db.execute("SELECT coalesce(sum(qty), 0) FROM cart_items WHERE owner = ?", (owner,)).fetchone()[0]

    def add_to_cart(self, owner: str, pid: int, qty: int) -> None:
        self.db.execute("INSERT INTO cart_items (owner, product_id, qty) VALUES (?, ?, ?) "
                        "ON CONFLICT(owner, product_id) DO UPDATE SET qty = qty + excluded.qty", (owner, pid, qty))

    def set_cart_qty(self, owner: str, pid: int, qty: int) -> None:
        if qty <= 0:
            self.remove_from_cart(owner, pid)
        else:
            self.db.execute("UPDATE cart_items SET qty = ? WHERE owner = ? AND product_id = ?", (qty, owner, pid))

    def remove_from_cart(self, owner: str, pid: int) -> None:
        self.db.execute("DELETE FROM cart_items WHERE owner = ? AND product_id = ?", (owner, pid))

    def merge_cart(self, src: str, dst: str) -> None:
        for row in self.db.execute("SELECT product_id, qty FROM cart_items WHERE owner = ?", (src,)).fetchall():
            self.add_to_cart(dst, row["product_id"], row["qty"])
        self.db.execute("DELETE FROM cart_items WHERE owner = ?", (src,))

    # wish list -------------------------------------------------------------------------
    def wishlist(self, cid: int) -> list[sqlite3.Row]:
        return self.db.execute(
            "SELECT w.added, p.* FROM wishlist_items w JOIN products p ON p.id = w.product_id WHERE w.customer_id = ?"
            " ORDER BY w.id", (cid,)).fetchall()

    def add_to_wishlist(self, cid: int, pid: int) -> None:
        self.db.execute("INSERT OR IGNORE INTO wishlist_items (customer_id, product_id, added) VALUES (?, ?, ?)",
                        (cid, pid, _now()[:10]))

    def remove_from_wishlist(self, cid: int, pid: int) -> None:
        self.db.execute("DELETE FROM wishlist_items WHERE customer_id = ? AND product_id = ?", (cid, pid))

    # orders ----------------------------------------------------------------------------
    def orders(self, cid: int, page: int = 1) -> tuple[list[sqlite3.Row], int]:
        total = self.db.execute("SELECT count(*) FROM orders WHERE customer_id = ?", (cid,)).fetchone()[0]
        rows = self.db.execute("SELECT * FROM orders WHERE customer_id = ? ORDER BY created DESC, id DESC "
                               "LIMIT ? OFFSET ?", (cid, ORDERS_PAGE, (max(1, page) - 1) * ORDERS_PAGE)).fetchall()
        return rows, total

    def order(self, oid: int) -> sqlite3.Row | None:
        return self.db.execute("SELECT * FROM orders WHERE id = ?", (oid,)).fetchone()

    def order_items(self, oid: int) -> list[sqlite3.Row]:
        return self.db.execute("SELECT oi.*, p.slug FROM order_items oi LEFT JOIN products p ON p.id = oi.product_id "
                               "WHERE oi.order_id = ? ORDER BY oi.id", (oid,)).fetchall()

    def place_order(self, cid: int, owner: str, address: dict, method: str) -> sqlite3.Row:
        items = self.cart(owner)
        if not items:
            raise ValueError("Your shopping cart is empty.")
        label, ship = SHIPPING.get(method, SHIPPING["flatrate"])
        subtotal = sum(r["price_cents"] * r["qty"] for r in items)
        last = self.db.execute("SELECT max(CAST(number AS INTEGER)) FROM orders").fetchone()[0] or 0
        cur = self.db.execute(
            "INSERT INTO orders (number, customer_id, created, status, ship_name, ship_street, ship_city, ship_region,"
            " ship_postcode, ship_country, shipping_method, shipping_cents, payment_method, subtotal_cents,"
            " total_cents) VALUES (?, ?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?, 'Check / Money order', ?, ?)",
            (f"{last + 1:09d}", cid, _now(), f"{address['firstname']} {address['lastname']}".strip(),
             address["street"], address["city"], address["region"], address["postcode"], address["country"],
             label, ship, subtotal, subtotal + ship))
        for r in items:
            self.db.execute("INSERT INTO order_items (order_id, product_id, name, sku, price_cents, qty) "
                            "VALUES (?, ?, ?, ?, ?, ?)", (cur.lastrowid, r["id"], r["name"], r["sku"],
                                                          r["price_cents"], r["qty"]))
        self.db.execute("DELETE FROM cart_items WHERE owner = ?", (owner,))
        return self.order(cur.lastrowid)

    # reviews and messages --------------------------------------------------------------
    def add_review(self, pid: int, cid: int | None, nickname: str, rating: int, title: str, body: str) -> None:
        self.db.execute("INSERT INTO reviews (product_id, customer_id, nickname, rating, title, body, created) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?)", (pid, cid, nickname, rating, title, body, _now()[:10]))

    def customer_reviews(self, cid: int) -> list[sqlite3.Row]:
        return self.db.execute("SELECT r.*, p.name AS product_name, p.slug FROM reviews r JOIN products p "
                               "ON p.id = r.product_id WHERE r.customer_id = ? ORDER BY r.id DESC", (cid,)).fetchall()

    def add_message(self, name: str, email: str, phone: str, comment: str) -> None:
        self.db.execute("INSERT INTO contact_messages (name, email, phone, comment, created) VALUES (?, ?, ?, ?, ?)",
                        (name, email, phone, comment, _now()))


_PRODUCT_SQL = ("SELECT p.*, coalesce(avg(r.rating), 0) AS rating, count(r.id) AS reviews "
                "FROM products p LEFT JOIN reviews r ON r.product_id = p.id")


def _price_buckets(prices: list[int]) -> list[tuple[str, str, int]]:
    """Price filter ranges (value "lo-hi" in dollars, label, count); the step follows the top price."""
    if not prices:
        return []
    top = max(prices) / 100
    step = 10 if top < 100 else 50 if top < 500 else 100
    counts: dict[int, int] = {}
    for c in prices:
        b = int(c // (step * 100))
        counts[b] = counts.get(b, 0) + 1
    return [(f"{b * step}-{(b + 1) * step}", f"{money(b * step * 100)} - {money((b + 1) * step * 100 - 1)}", n)
            for b, n in sorted(counts.items())]


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
