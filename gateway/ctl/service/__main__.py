"""`python -m gateway.ctl.service --template launchd|systemd`: the files under deploy/."""

import argparse
import sys

from gateway.ctl.service.actions import render
from gateway.ctl.service.spec import ManagerKind, template_spec

cli = argparse.ArgumentParser(prog="python -m gateway.ctl.service")
cli.add_argument("--template", choices=[k.value for k in ManagerKind], required=True)
sys.stdout.buffer.write(render(template_spec(ManagerKind(cli.parse_args().template))))
