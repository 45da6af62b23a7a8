"""Set-up for sqlite-top-customer: build shop.db deterministically.

Three customers are planted so that the easy mistakes give a different answer: Ada leads over all
years, Linus has the largest single 2023 order, Grace leads the 2023 total.
"""

import random
import sqlite3

NAMES = ["Ada", "Grace", "Linus", "Margaret", "Ken", "Barbara", "Dennis", "Frances", "Guido", "Radia"]

rng = random.Random(2023)
db = sqlite3.connect("shop.db")
db.executescript(
    """
    DROP TABLE IF EXISTS orders;
    DROP TABLE IF EXISTS customers;
    CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL);
    CREATE TABLE orders (
        id INTEGER PRIMARY KEY,
        customer_id INTEGER NOT NULL REFERENCES customers(id),
        placed_on TEXT NOT NULL,
        amount_cents INTEGER NOT NULL
    );
    """
)
db.executemany("INSERT INTO customers (id, name) VALUES (?, ?)", list(enumerate(NAMES, start=1)))
orders = []
for _ in range(3_000):
    year = rng.choice([2022, 2023, 2024])
    date = f"{year}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"
    orders.append((rng.randrange(1, len(NAMES) + 1), date, rng.randrange(500, 20_000)))
orders += [(1, "2022-03-04", 9_000_000), (2, "2023-06-01", 1_000_000), (2, "2023-07-01", 1_000_000)]
orders += [(3, "2023-11-11", 1_500_000)]
db.executemany("INSERT INTO orders (customer_id, placed_on, amount_cents) VALUES (?, ?, ?)", orders)
db.commit()
db.close()
