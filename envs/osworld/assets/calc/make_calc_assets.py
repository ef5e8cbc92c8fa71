"""Writes the spreadsheets of the Calc tasks (run inside an ``osworld`` workspace, which has
python3-openpyxl): ``python3 make_calc_assets.py OUTDIR``. The outputs are committed beside
this script; rerun it only to change them."""
import sys

from openpyxl import Workbook

out = sys.argv[1]


def book(name, sheet, rows):
    wb = Workbook()
    ws = wb.active
    ws.title = sheet
    for r in rows:
        ws.append(r)
    wb.save(f"{out}/{name}")


book("expenses.xlsx", "Expenses", [["Item", "Amount"], ["Rent", 1200], ["Food", 450], ["Travel", 230.5],
                                   ["Phone", 45], ["Books", 74.5]])
book("orders.xlsx", "Orders", [["Product", "Qty", "Price"], ["Pens", 10, 1.5], ["Paper", 4, 6.25],
                               ["Stapler", 2, 12], ["Folders", 25, 0.8], ["Tape", 6, 2.1]])
book("grades.xlsx", "Grades", [["Class", "Student", "Grade"], ["A", "Ann", 88], [None, "Ben", 92],
                               [None, "Cid", 75], ["B", "Dee", 81], [None, "Eve", 67], ["C", "Fay", 90],
                               [None, "Gus", 79]])
book("scores.xlsx", "Scores", [["Name", "Score"], ["Ann", 71], ["Ben", 84], ["Cid", 90], ["Dee", 66],
                               ["Eve", 77], ["Fay", 95], ["Gus", 58], ["Hal", 81]])
book("sales.xlsx", "Sales", [["Month", "Sales"]] + [[m, v] for m, v in zip(
    ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"],
    [1520, 1710, 1390, 2210, 1980, 2475, 2301, 1875, 2060, 2190, 2388, 2950], strict=True)])
