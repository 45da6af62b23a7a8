"""Run one SQL statement against shop.db and print each row, tab-separated."""

import sqlite3
import sys

if len(sys.argv) != 2:
    sys.exit('usage: python3 query.py "SQL"')
db = sqlite3.connect("shop.db")
for row in db.execute(sys.argv[1]):
    print("\t".join(str(v) for v in row))
db.close()
