"""``python -m pointalign`` and the ``pointalign`` command (needs the ``cli`` extra)."""

from __future__ import annotations

import sys


def main() -> None:
    """Run the command line, or say how to install it when typer/rich are missing."""
    try:
        from pointalign.cli import app
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        if missing and missing.split(".")[0] in ("typer", "rich", "click"):
            sys.stderr.write(f"the pointalign command needs {missing}: "
                             "pip install 'pointalign[cli]'\n")
            raise SystemExit(2) from None
        raise
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
