def make_user(username, email):
    """A user record."""
    return {"username": username, "email": email}


USERS = [make_user("ada", "ada@example.com"), make_user("linus", "linus@example.com")]
