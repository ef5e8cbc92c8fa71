# ruff: noqa: E501 - task data: instructions and oracles read best on one line
"""Writes the shipped task files (envs/osworld/tasks/<domain>/*.json) in OSWorld's format,
each with a scripted pyautogui oracle. Run: python3 envs/osworld/make_tasks.py"""
import json
import os
from pathlib import Path

HERE = Path(__file__).parent
T = str(HERE / "tasks")
A = "https://assets.bunshin-gym.local/"
def dl(*pairs):
    return {"type": "download", "parameters": {"files": [{"url": A + u, "path": p} for u, p in pairs]}}
def ex(cmd):
    return {"type": "execute", "parameters": {"command": cmd, "shell": True}}
def cmdline(cmd):
    return {"type": "vm_command_line", "command": cmd, "shell": True}
def rule(**r):
    return {"type": "rule", "rules": r}
def task(domain, name, instruction, config, evaluator, oracle, apps, max_steps=15):
    d = {"id": f"osworld/{name}", "snapshot": domain, "instruction": instruction, "source": "bunshin-gym",
         "trajectory": "trajectories/", "config": config, "related_apps": apps, "evaluator": evaluator,
         "max_steps": max_steps, "oracle": oracle}
    os.makedirs(f"{T}/{domain}", exist_ok=True)
    with open(f"{T}/{domain}/{name}.json", "w") as f:
        json.dump(d, f, indent=1)
        f.write("\n")
def w(text):
    return f"pyautogui.write({text!r})"
def hk(*keys):
    return "pyautogui.hotkey(" + ", ".join(repr(k) for k in keys) + ")"
W, D = "WAIT", "DONE"

# ---------------------------------------------------------------- os: terminal and files
task("os", "terminal-mkdir-projects", "Create a folder named projects in my home directory.", [],
     {"func": "exact_match", "result": cmdline("test -d /home/user/projects && echo yes"), "expected": rule(expected="yes\n")},
     [w("mkdir ~/projects\n"), W, D], ["terminal"])
task("os", "terminal-count-lines", "Count the lines of ~/data/measurements.txt and write just that number into ~/count.txt.",
     [ex("mkdir -p ~/data && seq 1 42 | sed 's/^/sample /' > ~/data/measurements.txt")],
     {"func": "exact_match", "result": cmdline("tr -d ' \\n' < ~/count.txt"), "expected": rule(expected="42")},
     [w("wc -l < ~/data/measurements.txt > ~/count.txt\n"), W, D], ["terminal"])
task("os", "files-rename-extension", "In ~/notes, rename every .txt file to have the .md extension instead.",
     [ex("mkdir -p ~/notes && for n in alpha beta gamma; do echo $n > ~/notes/$n.txt; done && echo keep > ~/notes/readme.rst")],
     {"func": "check_directory_tree", "result": {"type": "list_directory", "path": "/home/user/notes"},
      "expected": rule(include=["alpha.md", "beta.md", "gamma.md", "readme.rst"], exclude=["alpha.txt", "beta.txt", "gamma.txt"])},
     [w("cd ~/notes && for f in *.txt; do mv \"$f\" \"${f%.txt}.md\"; done; cd\n"), W, D], ["terminal"])
task("os", "terminal-make-executable", "Make the script ~/bin/backup.sh executable for its owner.",
     [ex("mkdir -p ~/bin && printf '#!/bin/sh\\necho backing up\\n' > ~/bin/backup.sh && chmod 644 ~/bin/backup.sh")],
     {"func": "exact_match", "result": cmdline("test -x ~/bin/backup.sh && ~/bin/backup.sh"), "expected": rule(expected="backing up\n")},
     [w("chmod u+x ~/bin/backup.sh\n"), W, D], ["terminal"])
task("os", "files-copy-report", "Copy the file report.txt from my Documents folder to my Desktop.",
     [dl(("os/report.txt", "/home/user/Documents/report.txt"))],
     {"func": "compare_text_file", "result": {"type": "vm_file", "path": "/home/user/Desktop/report.txt", "dest": "report.txt"},
      "expected": {"type": "cloud_file", "path": A + "os/report.txt", "dest": "report-gold.txt"}},
     [w("cp ~/Documents/report.txt ~/Desktop/\n"), W, D], ["terminal"])
task("os", "terminal-sudo-opt-dir", "Create the directory /opt/tools and make user the owner of it. My password is 'password'.",
     [],
     {"func": "exact_match", "result": cmdline("stat -c %U /opt/tools"), "expected": rule(expected="user\n")},
     [w("echo password | sudo -S mkdir -p /opt/tools && echo password | sudo -S chown user /opt/tools\n"), W, W, D], ["terminal"])
task("os", "terminal-grep-errors", "Save every line of ~/app.log that contains ERROR, in order, to ~/errors.txt.",
     [dl(("os/app.log", "/home/user/app.log"))],
     {"func": "compare_text_file", "result": {"type": "vm_file", "path": "/home/user/errors.txt", "dest": "errors.txt"},
      "expected": {"type": "cloud_file", "path": A + "os/errors-gold.txt", "dest": "errors-gold.txt"}},
     [w("grep ERROR ~/app.log > ~/errors.txt\n"), W, D], ["terminal"])
task("os", "terminal-sum-numbers", "Show the sum of the numbers in ~/numbers.txt in the terminal.",
     [ex("seq 1 100 > ~/numbers.txt")],
     {"func": "check_include_exclude", "result": {"type": "vm_terminal_output"}, "expected": rule(include=["\n5050\n"], exclude=[])},
     [w("awk '{s+=$1} END {print s}' ~/numbers.txt\n"), W, D], ["terminal"])
task("os", "files-archive-documents", "Create a gzip-compressed tar archive ~/backup.tar.gz of my Documents folder.",
     [dl(("os/report.txt", "/home/user/Documents/report.txt"))],
     {"func": "check_include_exclude", "result": cmdline("tar tzf ~/backup.tar.gz"),
      "expected": rule(include=["Documents/report.txt"], exclude=[])},
     [w("tar czf ~/backup.tar.gz -C ~ Documents\n"), W, D], ["terminal"])
task("os", "files-delete-tmp", "Delete every file ending in .tmp anywhere under ~/cache, and nothing else.",
     [ex("mkdir -p ~/cache/a/b && touch ~/cache/x.tmp ~/cache/a/y.tmp ~/cache/a/b/z.tmp ~/cache/keep.dat ~/cache/a/b/keep.txt")],
     {"func": "check_directory_tree", "result": {"type": "list_directory", "path": "/home/user/cache"},
      "expected": rule(include=["keep.dat", "a/b/keep.txt", "a/b/"], exclude=["x.tmp", "a/y.tmp", "a/b/z.tmp"])},
     [w("find ~/cache -name '*.tmp' -type f -delete\n"), W, D], ["terminal"])
task("os", "os-install-office-infeasible", "Install Microsoft Office 365 from the Ubuntu Software Center.", [],
     {"func": "infeasible"}, ["FAIL"], ["os"])

# ---------------------------------------------------------------- editor (mousepad)
def open_(path):
    return {"type": "open", "parameters": {"path": path}}
task("editor", "editor-write-greeting", "Type the text 'Hello, world!' into the open file greeting.txt and save it.",
     [ex("touch ~/greeting.txt"), open_("/home/user/greeting.txt")],
     {"func": "check_include_exclude", "result": cmdline("cat ~/greeting.txt"), "expected": rule(include=["Hello, world!"], exclude=[])},
     [w("Hello, world!"), hk("ctrl", "s"), W, D], ["mousepad"])
task("editor", "editor-british-to-american", "In colours.txt, change every 'colour' to 'color' (keep the capital C where there is one) and save.",
     [dl(("editor/colours.txt", "/home/user/colours.txt")), open_("/home/user/colours.txt")],
     {"func": "compare_text_file", "result": {"type": "vm_file", "path": "/home/user/colours.txt", "dest": "colours.txt"},
      "expected": {"type": "cloud_file", "path": A + "editor/colours-gold.txt", "dest": "colours-gold.txt"}},
     [hk("ctrl", "a"), w((HERE / "assets/editor/colours-gold.txt").read_text()), hk("ctrl", "s"), W, D], ["mousepad"])
task("editor", "editor-append-item", "Add '- milk' as a new last item of the shopping list and save it.",
     [dl(("editor/shopping.txt", "/home/user/shopping.txt")), open_("/home/user/shopping.txt")],
     {"func": "compare_text_file", "result": {"type": "vm_file", "path": "/home/user/shopping.txt", "dest": "shopping.txt"},
      "expected": {"type": "cloud_file", "path": A + "editor/shopping-gold.txt", "dest": "shopping-gold.txt"}},
     [hk("ctrl", "end"), w("- milk\n"), hk("ctrl", "s"), W, D], ["mousepad"])
task("editor", "editor-fix-port", "The port in server.conf has a typo: set it to 8080 and save the file.",
     [dl(("editor/server.conf", "/home/user/server.conf")), open_("/home/user/server.conf")],
     {"func": "compare_text_file", "result": {"type": "vm_file", "path": "/home/user/server.conf", "dest": "server.conf"},
      "expected": {"type": "cloud_file", "path": A + "editor/server-gold.conf", "dest": "server-gold.conf"}},
     [hk("ctrl", "a"), w((HERE / "assets/editor/server-gold.conf").read_text()), hk("ctrl", "s"), W, D], ["mousepad"])
task("editor", "editor-remove-draft-line", "Remove the first line (the DRAFT marker) from notes.txt and save.",
     [dl(("editor/notes.txt", "/home/user/notes.txt")), open_("/home/user/notes.txt")],
     {"func": "compare_text_file", "result": {"type": "vm_file", "path": "/home/user/notes.txt", "dest": "notes.txt"},
      "expected": {"type": "cloud_file", "path": A + "editor/notes-gold.txt", "dest": "notes-gold.txt"}},
     [hk("ctrl", "home"), hk("shift", "down"), "pyautogui.press('delete')", hk("ctrl", "s"), W, D], ["mousepad"])
task("editor", "editor-enable-debug", "In app.json, turn the debug setting on (true) and save the file.",
     [ex("printf '{\"name\": \"demo\", \"debug\": false, \"port\": 8080}\\n' > ~/app.json"), open_("/home/user/app.json")],
     {"func": "check_direct_json_object", "result": cmdline("cat ~/app.json"),
      "expected": rule(expected={"name": "demo", "debug": True, "port": 8080})},
     [hk("ctrl", "a"), w('{"name": "demo", "debug": true, "port": 8080}\n'), hk("ctrl", "s"), W, D], ["mousepad"])
task("editor", "editor-todo-save-as", "Write 'buy stamps' in the open notes file and save it as todo.txt in my Documents folder.",
     [ex("touch ~/scratch.txt"), open_("/home/user/scratch.txt")],
     {"func": "check_include_exclude", "result": cmdline("cat ~/Documents/todo.txt"), "expected": rule(include=["buy stamps"], exclude=[])},
     [w("buy stamps"), hk("ctrl", "shift", "s"), "import time; time.sleep(1.5)", hk("ctrl", "a"), w("/home/user/Documents/todo.txt\n"), W, W, D], ["mousepad"])

# ---------------------------------------------------------------- chromium
SITE = ["index.html", "about.html", "contact.html", "search.html", "ads.html", "thanks.html", "download.html", "report.csv", "server.py"]
def site(*urls):
    return [dl(*[(f"site/{f}", f"/home/user/site/{f}") for f in SITE]),
            {"type": "launch", "parameters": {"command": ["python3", "/home/user/site/server.py"]}},
            {"type": "sleep", "parameters": {"seconds": 1}},
            {"type": "chrome_open_tabs", "parameters": {"urls_to_open": list(urls)}}]
U = "http://localhost:8000/"
task("chrome", "chrome-open-about", "Go to the About page of this site in the current tab.", site(U + "index.html"),
     {"func": "is_expected_active_tab", "result": {"type": "active_tab_info"}, "expected": rule(type="url", url=U + "about.html")},
     [hk("ctrl", "l"), w(U + "about.html\n"), W, D], ["chrome"])
task("chrome", "chrome-new-tab-contact", "Open the site's contact page (http://localhost:8000/contact.html) in a new tab, keeping the home page open.",
     site(U + "index.html"),
     {"func": "is_expected_tabs", "result": {"type": "open_tabs_info"}, "expected": rule(type="url", urls=[U + "index.html", U + "contact.html"])},
     [hk("ctrl", "t"), "import time; time.sleep(0.5)", w(U + "contact.html\n"), W, D], ["chrome"])
task("chrome", "chrome-site-search", "Use the search box on this page to search for 'bunshin'.", site(U + "search.html"),
     {"func": "is_expected_active_tab", "result": {"type": "active_tab_info"}, "expected": rule(type="url", url=U + "search.html?q=bunshin")},
     [w("bunshin\n"), W, D], ["chrome"])
task("chrome", "chrome-contact-form", "Send the contact form with the name 'Ada Lovelace' and the email 'ada@example.org'.", site(U + "contact.html"),
     {"func": "check_include_exclude", "result": cmdline("cat ~/site/submissions.log"),
      "expected": rule(include=["name=Ada Lovelace&email=ada@example.org"], exclude=[])},
     [w("Ada Lovelace\tada@example.org\n"), W, D], ["chrome"])
task("chrome", "chrome-close-ad-tab", "Close the tab with the advertisement, keep the other one.", site(U + "index.html", U + "ads.html"),
     {"func": "is_expected_tabs", "result": {"type": "open_tabs_info"}, "expected": rule(type="url", urls=[U + "index.html"])},
     [hk("ctrl", "2"), "import time; time.sleep(0.5)", hk("ctrl", "w"), W, D], ["chrome"])
task("chrome", "chrome-download-report", "Download the sales report offered on this page into my Downloads folder.", site(U + "download.html"),
     {"func": "compare_csv", "result": {"type": "vm_file", "path": "/home/user/Downloads/report.csv", "dest": "report.csv"},
      "expected": {"type": "cloud_file", "path": A + "site/report.csv", "dest": "report-gold.csv"}},
     ["pyautogui.press('enter')", W, W, D], ["chrome"])
task("multi_apps", "chrome-price-to-file", "Look up the price of the blue widget on the shop's home page and write just the number (like 1.23) into ~/price.txt.",
     site(U + "index.html"),
     {"func": "exact_match", "result": cmdline("tr -d ' \\n$' < ~/price.txt"), "expected": rule(expected="4.25")},
     ["pyautogui.click(1010, 400)", "import time; time.sleep(0.5)", w("echo 4.25 > ~/price.txt\n"), W, D], ["chrome", "terminal"])

# ---------------------------------------------------------------- calc
def calc(fname, url):
    return [dl((url, f"/home/user/{fname}")), open_(f"/home/user/{fname}")]
def save_post(fname):
    return [{"type": "activate_window", "parameters": {"window_name": f"{fname} - LibreOffice Calc", "strict": True}},
            {"type": "sleep", "parameters": {"seconds": 0.5}},
            {"type": "execute", "parameters": {"command": ["python", "-c", "import pyautogui; pyautogui.hotkey(\"ctrl\", \"s\");"]}},
            {"type": "sleep", "parameters": {"seconds": 3}}]
def go(col, row):
    # a click in the grid first: the keyboard focus is then surely in the sheet
    # LibreOffice handles a burst of keys out of order (a Down pressed before the typed text
    # sometimes lands after it), so every navigation step is followed by a pause
    nap = "import time; time.sleep(0.5)"
    return (["pyautogui.click(900, 700)", nap, hk("ctrl", "home"), nap]
            + ([f"pyautogui.press('right', presses={col})", nap] if col else [])
            + ([f"pyautogui.press('down', presses={row})", nap] if row else []))
def cell(coord, method, ref):
    return {"type": "check_cell", "sheet_idx": 0, "coordinate": coord, "props": {"value": {"method": method, "ref": ref}}}
task("calc", "calc-sum-expenses", "In cell B7 of expenses.xlsx, compute the total of the amounts in B2:B6.", calc("expenses.xlsx", "calc/expenses.xlsx"),
     {"postconfig": save_post("expenses.xlsx"), "func": "compare_table",
      "result": {"type": "vm_file", "path": "/home/user/expenses.xlsx", "dest": "expenses.xlsx"},
      "options": {"rules": [cell("B7", "eq", 2000)]}},
     go(1, 6) + [w("=SUM(B2:B6)\n"), W, D], ["libreoffice calc"])
task("calc", "calc-order-totals", "Add a column D titled 'Total' that holds Qty times Price for every order row.", calc("orders.xlsx", "calc/orders.xlsx"),
     {"postconfig": save_post("orders.xlsx"), "func": "compare_table",
      "result": {"type": "vm_file", "path": "/home/user/orders.xlsx", "dest": "orders.xlsx"},
      "expected": {"type": "cloud_file", "path": A + "calc/orders-gold.csv", "dest": "orders-gold.csv"},
      "options": {"rules": [{"type": "sheet_data", "sheet_idx0": "RI0", "sheet_idx1": "EI0"}]}},
     go(3, 0) + [w("Total\n" + "".join(f"=B{r}*C{r}\n" for r in range(2, 7))), W, D], ["libreoffice calc"])
task("calc", "calc-fill-class-blanks", "Fill every blank cell in the Class column with the class written above it.", calc("grades.xlsx", "calc/grades.xlsx"),
     {"postconfig": save_post("grades.xlsx"), "func": "compare_table",
      "result": {"type": "vm_file", "path": "/home/user/grades.xlsx", "dest": "grades.xlsx"},
      "expected": {"type": "cloud_file", "path": A + "calc/grades-gold.csv", "dest": "grades-gold.csv"},
      "options": {"rules": [{"type": "sheet_data", "sheet_idx0": "RI0", "sheet_idx1": "EI0"}]}},
     go(0, 2) + [w("A\nA\nB\nB\nC\nC\n"), W, D], ["libreoffice calc"])
task("calc", "calc-average-score", "Put the average of the scores (B2:B9) in cell B10.", calc("scores.xlsx", "calc/scores.xlsx"),
     {"postconfig": save_post("scores.xlsx"), "func": "compare_table",
      "result": {"type": "vm_file", "path": "/home/user/scores.xlsx", "dest": "scores.xlsx"},
      "options": {"rules": [cell("B10", "approx:0.01", 77.75)]}},
     go(1, 9) + [w("=AVERAGE(B2:B9)\n"), W, D], ["libreoffice calc"])
task("calc", "calc-max-sales", "In cell B14, put the highest monthly sales figure of the year (B2:B13).", calc("sales.xlsx", "calc/sales.xlsx"),
     {"postconfig": save_post("sales.xlsx"), "func": "compare_table",
      "result": {"type": "vm_file", "path": "/home/user/sales.xlsx", "dest": "sales.xlsx"},
      "options": {"rules": [cell("B14", "eq", 2950)]}},
     go(1, 13) + [w("=MAX(B2:B13)\n"), W, D], ["libreoffice calc"])
task("calc", "calc-csv-update-bolts", "In inventory.csv, set the quantity of bolts to 75 and save it, keeping the CSV format.", calc("inventory.csv", "calc/inventory.csv"),
     {"postconfig": save_post("inventory.csv"), "func": "compare_csv",
      "result": {"type": "vm_file", "path": "/home/user/inventory.csv", "dest": "inventory.csv"},
      "expected": {"type": "cloud_file", "path": A + "calc/inventory-gold.csv", "dest": "inventory-gold.csv"}},
     go(1, 2) + [w("75\n"), W, D], ["libreoffice calc"])
