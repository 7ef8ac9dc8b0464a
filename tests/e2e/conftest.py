"""tests/e2e/scripts/ holds user scripts the tests launch as programs; pytest must not import them."""
collect_ignore_glob = ["scripts/*"]
