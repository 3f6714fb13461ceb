"""The checkpoint a sandbox's state last came from (time travel: the parent of its next checkpoint).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sandboxes", sa.Column("checkpoint_id", sa.Text, nullable=True))


def downgrade() -> None:
    op.drop_column("sandboxes", "checkpoint_id")
