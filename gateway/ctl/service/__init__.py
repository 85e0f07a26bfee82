"""gatewayctl service: the gateway as a launchd (macOS) or systemd (Linux) service.

`spec.build_spec` resolves what the service runs from the installing environment;
`launchd.launchd_plist` and `systemd.systemd_unit` turn that into the file, purely; `actions`
writes it and drives launchctl or systemctl through a `manager.Manager`, and reports status.
`python -m gateway.ctl.service --template launchd|systemd` prints the files under deploy/.
"""

from gateway.ctl.service.actions import (
    add_arguments,
    check_root,
    format_status,
    install,
    main,
    manager_for,
    render,
    restart,
    status,
    uninstall,
)
from gateway.ctl.service.launchd import Launchd, launchd_plist
from gateway.ctl.service.manager import Manager, ManagerState
from gateway.ctl.service.spec import (
    LABEL,
    RESTART_DELAY_S,
    UNIT,
    ManagerKind,
    ServiceError,
    ServiceSpec,
    build_spec,
    template_spec,
)
from gateway.ctl.service.systemd import Systemd, systemd_unit

__all__ = [
    "LABEL",
    "RESTART_DELAY_S",
    "UNIT",
    "Launchd",
    "Manager",
    "ManagerKind",
    "ManagerState",
    "ServiceError",
    "ServiceSpec",
    "Systemd",
    "add_arguments",
    "build_spec",
    "check_root",
    "format_status",
    "install",
    "launchd_plist",
    "main",
    "manager_for",
    "render",
    "restart",
    "status",
    "systemd_unit",
    "template_spec",
    "uninstall",
]
