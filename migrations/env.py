"""Alembic environment: render the migrations as SQL for :mod:`migrations.runner`.

dracap's one PostgreSQL driver is asyncpg; SQLAlchemy's asyncpg dialect needs
``greenlet``, which dracap does not depend on. So alembic always runs in *offline*
mode here: it renders the chosen revision range (schema statements plus the
``alembic_version`` bookkeeping) as one SQL script, and
:mod:`migrations.runner` executes that script over asyncpg under an advisory
lock. The revisions are plain SQL (no SQLAlchemy models, no autogenerate), so nothing
is lost by not having a live connection while rendering.

``migrations.runner`` puts the process's ``Settings`` in
``config.attributes["settings"]``; the revisions read the app role's name from there.
"""

from __future__ import annotations

from alembic import context

if not context.is_offline_mode():
    raise RuntimeError(
        "dracap migrations render SQL only; run them with `dracap db upgrade` "
        "(migrations.runner), or pass --sql to alembic"
    )

context.configure(
    dialect_name="postgresql",
    literal_binds=True,
    transactional_ddl=True,
    transaction_per_migration=False,
)
with context.begin_transaction():
    context.run_migrations()
