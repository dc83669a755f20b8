#!/usr/bin/env bash
# Chromium for the report's browser test (tests/test_report.py), where it can be installed: as root with apt-get
# (Debian / Ubuntu). Anywhere else it says so and carries on: that one test then skips, naming the reason.
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Chromium (apt-get) for the report's browser test"
    if apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; then
        exit 0
    fi
fi
echo "Chromium is not installed and could not be (needs root and apt-get): the report's browser test will skip"
exit 0
