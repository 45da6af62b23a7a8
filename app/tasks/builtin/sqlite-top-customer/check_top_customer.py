"""Validation for sqlite-top-customer: top_customer.txt names the customer with the largest 2023 total."""

import sqlite3
import sys

db = sqlite3.connect("shop.db")
(want,) = db.execute(
    "SELECT c.name FROM orders o JOIN customers c ON c.id = o.customer_id"
    " WHERE o.placed_on >= '2023-01-01' AND o.placed_on < '2024-01-01'"
    " GROUP BY c.id ORDER BY SUM(o.amount_cents) DESC LIMIT 1"
).fetchone()
db.close()
try:
    with open("top_customer.txt") as f:
        got = f.read().strip()
except FileNotFoundError:
    sys.exit("FAIL: top_customer.txt is missing")
if got != want:
    sys.exit(f"FAIL: top_customer.txt holds {got!r}, want {want!r}")
print("ok")
