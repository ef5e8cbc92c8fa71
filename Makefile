# Convenience targets; each runs the set-up first (idempotent, seconds when done).
.PHONY: setup run test test-slow lint bench
setup:
	scripts/setup.sh
run:
	scripts/main.sh
test:
	scripts/test.sh
test-slow:
	scripts/test.sh --slow
lint:
	.venv/bin/ruff check bunshin_gym envs tests bench
bench:
	.venv/bin/bunshin bench workspace --json bench/results/workspace.json
