"""What `idemctl doctor` checks on MariaDB and MySQL: the facts and their
assessment live with the engine (`idemctl.storage.failover.mysql`); this
path keeps working."""

from __future__ import annotations

from ..storage.failover.mysql import MysqlFacts, assess_mysql

__all__ = ["MysqlFacts", "assess_mysql"]
