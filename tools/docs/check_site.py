"""Look at the built documentation site as a user would (``make docs-check``).

Serves ``site/`` on localhost, opens the front page, a guide, the mechanism (with its
picture), the reference and the troubleshooting page in headless Chromium (Debian's ``chromium`` and
``chromium-driver``), and fails on a console error (a script error, a resource that does
not load), on an image that did not load, or on a page without its title. It also checks
that the built reference shows every public name of ``recomp``, ``recomp.torch``,
``recomp.mindspore``, their ``report`` and ``hyperparallel`` modules, ``recomp.plan`` and
``recomp.plan.solver``, and every error class, read from the sources' ``__all__`` (no
framework needed). Saves a screenshot of the front page (``make
docs-check`` puts it in ``out/site-front.png``; the README shows
``docs/images/site-front.png``, made with ``make docs-check SCREENSHOT=docs/images/site-front.png``).

    python tools/docs/check_site.py [--site site] [--screenshot out/site-front.png]
"""

from __future__ import annotations

import argparse
import ast
import functools
import http.server
import shutil
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Pages to open, with a text each must show once rendered.
PAGES = {
    "index.html": "out of the recompute",
    "guides/huggingface.html": "hf_activation_checkpointing",
    "mechanism.html": "What an excluded region is",
    "reference/torch.html": "checkpoint_exclude_wrapper",
    "troubleshooting.html": "DoubleCheckpointError",
}
# Reference page per package; the public names come from the package's __all__.
REFERENCE = {
    "recomp": ("src/recomp/__init__.py", "reference/recomp.html"),
    "recomp.torch": ("src/recomp/torch/__init__.py", "reference/torch.html"),
    "recomp.mindspore": ("src/recomp/mindspore/__init__.py", "reference/mindspore.html"),
    "recomp.plan": ("src/recomp/plan/__init__.py", "reference/plan.html"),
    "recomp.torch.report": ("src/recomp/torch/report.py", "reference/torch.html"),
    "recomp.mindspore.report": ("src/recomp/mindspore/report.py", "reference/mindspore.html"),
    "recomp.torch.hyperparallel": (
        "src/recomp/torch/hyperparallel.py",
        "reference/torch-hyperparallel.html",
    ),
    "recomp.mindspore.hyperparallel": (
        "src/recomp/mindspore/hyperparallel.py",
        "reference/mindspore-hyperparallel.html",
    ),
    "recomp.plan.solver": ("src/recomp/plan/solver.py", "reference/plan.html"),
}
ERRORS = "reference/errors.html"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
)


def public_names(init: Path) -> list[str]:
    tree = ast.parse(init.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return [n for n in ast.literal_eval(node.value) if not n.startswith("_")]
    raise SystemExit(f"{init}: no __all__")


def check_reference(site: Path) -> list[str]:
    problems = []
    for package, (init, page) in REFERENCE.items():
        html = (site / page).read_text()
        for name in public_names(ROOT / init):
            if package == "recomp" and name[0].isupper() and name.endswith(("Error", "Warning")):
                continue  # on the errors page
            if f'id="{package}.{name}"' not in html:
                problems.append(f"{page}: no entry for {package}.{name}")
    errors_html = (site / ERRORS).read_text()
    for name in public_names(ROOT / "src/recomp/errors.py"):
        if f'id="recomp.errors.{name}"' not in errors_html:
            problems.append(f"{ERRORS}: no entry for recomp.errors.{name}")
    return problems


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def browser(profile: str):  # type: ignore[no-untyped-def]
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver_path is None:
        raise SystemExit(
            "check_site: needs Chromium and its driver from Debian's packages: "
            "apt-get update && apt-get install -y chromium chromium-driver"
        )
    options.binary_location = binary
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


BROKEN_IMAGES = """
return Array.from(document.images)
    .filter(img => !img.complete || img.naturalWidth === 0)
    .map(img => img.getAttribute('src'));
"""


def check_pages(site: Path, screenshot: Path | None) -> list[str]:
    problems = []
    server, port = serve(site)
    profile = tempfile.mkdtemp(prefix="recomp-docs-chromium-")
    driver = browser(profile)
    try:
        for page, text in PAGES.items():
            driver.get(f"http://127.0.0.1:{port}/{page}")
            driver.execute_script("return document.readyState")
            body = driver.find_element("tag name", "body").text
            if text not in body:
                problems.append(f"{page}: does not show {text!r}")
            if not driver.title.strip():
                problems.append(f"{page}: no title")
            images = driver.execute_script(BROKEN_IMAGES)
            problems += [f"{page}: image {src} did not load" for src in images]
            for entry in driver.get_log("browser"):
                if entry.get("level") == "SEVERE":
                    problems.append(f"{page}: console error: {entry.get('message')}")
            print(f"opened {page}: {len(body)} characters, title {driver.title!r}")
            if page == "index.html" and screenshot is not None:
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(screenshot))
                print(f"screenshot: {screenshot}")
    finally:
        driver.quit()
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site")
    parser.add_argument("--screenshot", type=Path, default=ROOT / "out/site-front.png")
    parser.add_argument("--no-browser", action="store_true", help="check the reference only")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").exists():
        print(f"{args.site}: no built site; run `make docs` first", file=sys.stderr)
        return 2
    problems = check_reference(args.site)
    if not args.no_browser:
        problems += check_pages(args.site, args.screenshot)
    for problem in problems:
        print(problem, file=sys.stderr)
    print("site check:", "failed" if problems else "ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
