from dates.years import days_in_year, is_leap

__all__ = ["days_in_year", "is_leap"]
