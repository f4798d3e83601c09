from accounts.models import USERS


def find(username):
    """The user record named `username`, or None."""
    for user in USERS:
        if user.get("name") == username:
            return user
    return None


def display_name(username):
    """'username <email>' for a known user, 'unknown' otherwise."""
    user = find(username)
    return f"{user['username']} <{user['email']}>" if user else "unknown"
