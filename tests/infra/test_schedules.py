"""The policy's five-field cron expressions as EventBridge Scheduler expressions."""

from __future__ import annotations

import pytest

from infra.components.schedules import scheduler_cron
from infra.constants import PROMOTED_TAG
from shardvault.config.policy import PolicyError
from shardvault.lifecycle import promote


@pytest.mark.parametrize(
    ("cron", "expected"),
    [
        ("0 2 * * 0", "cron(0 2 ? * SUN *)"),
        ("0 2 * * 7", "cron(0 2 ? * SUN *)"),  # cron's second Sunday
        ("0 2 * * 1-6", "cron(0 2 ? * MON-SAT *)"),
        ("30 3 * * *", "cron(30 3 * * ? *)"),
        ("15 1 1 * *", "cron(15 1 1 * ? *)"),
        ("0 */6 * * 1,3,5", "cron(0 */6 ? * MON,WED,FRI *)"),
    ],
)
def test_cron_conversion(cron: str, expected: str) -> None:
    assert scheduler_cron(cron) == expected


def test_both_day_fields_restricted_is_refused_by_the_policys_own_rule() -> None:
    """The one rule the policy file is validated with (a valid policy never gets here)."""
    with pytest.raises(PolicyError) as raised:
        scheduler_cron("0 2 1 * 1")
    assert "restricts both the day of month and the day of week" in raised.value.message
    assert "restrict only one of the two" in raised.value.fix


def test_the_lifecycle_rule_and_the_promotion_use_the_same_tag() -> None:
    assert PROMOTED_TAG == promote.PROMOTED_TAG
