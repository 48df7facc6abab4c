"""Alembic environment: render the migrations as SQL for :mod:`services.runtime.migrating`.

dracap's one PostgreSQL driver is asyncpg; SQLAlchemy's asyncpg dialect needs
``greenlet``, which dracap does not depend on. So alembic always runs in *offline*
mode here: it renders the chosen revision range (schema statements plus the
``alembic_version`` bookkeeping) as one SQL script, and
:mod:`services.runtime.migrating` executes that script over asyncpg under an advisory
lock. The revisions are plain SQL (no SQLAlchemy models, no autogenerate), so nothing
is lost by not having a live connection while rendering.

``services.runtime.migrating`` puts the process's ``Settings`` in
``config.attributes["settings"]``; the revisions read the app role's name from there.
"""

from __future__ import annotations

from alembic import context

if not context.is_offline_mode():
    raise RuntimeError(
        "dracap migrations render SQL only; run them with `dracap db upgrade` "
        "(services.runtime.migrating), or pass --sql to alembic"
    )

context.configure(
    dialect_name="postgresql",
    literal_binds=True,
    transactional_ddl=True,
    transaction_per_migration=False,
)
with context.begin_transaction():
    context.run_migrations()
